//! The web console: one page with its script and style, embedded in the binary so that it needs
//! nothing at run time (no CDN, no build step). The page is only a view: it reads the gateway's own
//! API and `/metrics` from the browser, with the key a person types in (kept in the tab's session
//! storage, never sent anywhere but this gateway), and shows the plans the gateway drew.

/// Where the console is served (`/` redirects here).
pub const PATH: &str = "/console";

/// A file of the console.
pub struct Asset {
    pub content_type: &'static str,
    pub body: &'static [u8],
}

/// Whether `path` is the console's (an unknown file under it is a 404 of its own).
pub fn owns(path: &str) -> bool {
    path == PATH || path.starts_with("/console/")
}

/// The console's file at `path`.
pub fn asset(path: &str) -> Option<Asset> {
    let (content_type, body): (&'static str, &'static [u8]) = match path {
        "/console" | "/console/" => ("text/html; charset=utf-8", include_bytes!("index.html")),
        "/console/console.js" => (
            "text/javascript; charset=utf-8",
            include_bytes!("console.js"),
        ),
        "/console/console.css" => ("text/css; charset=utf-8", include_bytes!("console.css")),
        _ => return None,
    };
    Some(Asset { content_type, body })
}

/// Headers of every console file. The page runs only its own script and loads only its own files,
/// the pictures the API returns (data URLs) and the media the person chose (blob URLs); it may not
/// be framed. Revalidated on every load, so that a new binary's page is never mixed with an old
/// script.
pub const HEADERS: [(&str, &str); 4] = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
         media-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_files_the_gateway_serves() {
        let page = String::from_utf8_lossy(asset(PATH).map(|a| a.body).unwrap_or_default());
        for reference in ["/console/console.js", "/console/console.css"] {
            assert!(page.contains(reference), "{reference}");
            assert!(asset(reference).is_some(), "{reference}");
        }
        // Nothing from elsewhere: the console works with no network.
        assert!(!page.contains("http://") && !page.contains("https://"));
        assert!(owns("/console/nothing.js") && asset("/console/nothing.js").is_none());
        assert!(!owns("/consoles"));
    }
}
