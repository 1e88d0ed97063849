//! Recognising what an uploaded file is, from its bytes rather than its name or a client's claim.

use base64::Engine as _;

/// The MIME type the leading bytes of `data` identify (e.g. `image/png`), if any.
pub fn sniff_mime_type(data: &[u8]) -> Option<&'static str> {
    infer::get(data).map(|kind| kind.mime_type())
}

/// Characters of a base64 payload decoded to tell what it holds: enough for any magic number.
const SNIFFED_BASE64_CHARS: usize = 4096;

/// [`sniff_mime_type`] of a base64 payload, from its first few kilobytes alone (a payload is
/// decoded whole only once its limits allow).
pub fn sniff_base64(payload: &str) -> Result<Option<&'static str>, base64::DecodeError> {
    // Bytes, not characters: a payload that is not base64 may hold any UTF-8.
    let head = &payload.as_bytes()[..payload.len().min(SNIFFED_BASE64_CHARS) / 4 * 4];
    let bytes = base64::engine::general_purpose::STANDARD.decode(head)?;
    Ok(sniff_mime_type(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_common_containers_by_magic_bytes() {
        assert_eq!(
            sniff_mime_type(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"),
            Some("image/png")
        );
        assert_eq!(
            sniff_mime_type(b"\xff\xd8\xff\xe0\0\x10JFIF\0"),
            Some("image/jpeg")
        );
        assert_eq!(sniff_mime_type(b"GIF89a\x01\0\x01\0"), Some("image/gif"));
        assert_eq!(sniff_mime_type(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff_mime_type(b"plain text, not media"), None);
        assert_eq!(sniff_mime_type(b""), None);
        assert_eq!(
            sniff_mime_type(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"),
            Some("application/pdf")
        );
    }

    #[test]
    fn a_base64_payload_is_told_by_its_head() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
        png.resize(100_000, 0);
        let png = base64::engine::general_purpose::STANDARD.encode(&png);
        assert_eq!(sniff_base64(&png), Ok(Some("image/png")));
        assert!(sniff_base64("not base64 at all!").is_err());
    }
}
