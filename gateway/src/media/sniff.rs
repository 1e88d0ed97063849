//! Recognising what an uploaded file is, from its bytes rather than its name or a client's claim.

/// The MIME type the leading bytes of `data` identify (e.g. `image/png`), if any.
pub fn sniff_mime_type(data: &[u8]) -> Option<&'static str> {
    infer::get(data).map(|kind| kind.mime_type())
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
    }
}
