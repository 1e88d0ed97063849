//! One media item's account: what `usage.media[i]` and the `x-mmgate-media` header say of it.
//! Typed where the gateway reads it back (metrics, the drop policy, the upstream rewrite) and
//! rendered to JSON in one place, with the plugin's report of the item (plugin, sizes, what the
//! plan chose and why) carried in its order.

use serde_json::{Map, Value, json};

use super::documents::PageOf;
use super::pipeline;
use mmgate_host::LoadedPlugin;
use mmgate_inference::families::MediaKind;

#[derive(Debug, Clone)]
pub struct MediaAccount {
    pub index: usize,
    pub kind: MediaKind,
    /// Tokens the item costs in the prompt (0 once dropped).
    pub tokens: usize,
    /// Whether the budget cut the item.
    pub reduced: bool,
    /// Time in the item's plugin (probe, plan, preprocess); `None` for `image_embeds`.
    pub plugin_ms: Option<f64>,
    /// Why the item left the request under the drop policy.
    pub dropped: Option<String>,
    /// The document page this item is, when it is one: `usage.media` tells a document's pages
    /// as one entry.
    pub page: Option<PageOf>,
    /// The rest of the item's report, in its order (`tokens`, `reduced` and `reason` among it are
    /// rendered from the typed fields).
    details: Map<String, Value>,
}

impl MediaAccount {
    /// An item run through its plugin.
    pub fn plugin(
        index: usize,
        kind: MediaKind,
        plugin: &LoadedPlugin,
        processed: &pipeline::Processed,
    ) -> Self {
        let details: Map<String, Value> = pipeline::report(plugin, processed)
            .into_iter()
            .filter(|(key, _)| !matches!(key.as_str(), "tensors" | "time_ms" | "choices"))
            .collect();
        let t = &processed.timings;
        let plugin_ms = (t.probe + t.plan + t.preprocess).as_secs_f64() * 1e3;
        Self {
            index,
            kind,
            tokens: processed.plan.tokens as usize,
            reduced: processed.plan.reduced,
            plugin_ms: Some((plugin_ms * 1e3).round() / 1e3),
            dropped: None,
            page: None,
            details,
        }
    }

    /// An `image_embeds` part: it costs the tokens it holds.
    pub fn embeddings(index: usize, kind: MediaKind, tokens: usize) -> Self {
        let mut details = Map::new();
        details.insert("source".into(), json!("image_embeds"));
        details.insert("tokens".into(), json!(tokens));
        Self {
            index,
            kind,
            tokens,
            reduced: false,
            plugin_ms: None,
            dropped: None,
            page: None,
            details,
        }
    }

    /// The account of a document's page, when the item is one.
    pub fn of_page(mut self, page: Option<PageOf>) -> Self {
        self.page = page;
        self
    }

    /// The drop policy took the item out of the request: it costs nothing, and says why.
    pub fn drop_for(&mut self, reason: &str) {
        self.tokens = 0;
        self.dropped = Some(format!("encoding failed: {reason}"));
    }

    /// The account as JSON; `with_timing: false` leaves out the plugin's time (output that must
    /// repeat exactly, as `mmgate generate`'s).
    pub fn to_json(&self, with_timing: bool) -> Value {
        let mut out = Map::new();
        out.insert("index".into(), json!(self.index));
        out.insert("kind".into(), json!(self.kind.name()));
        for (key, value) in &self.details {
            let value = match key.as_str() {
                "tokens" => json!(self.tokens),
                "reduced" => json!(self.reduced),
                "reason" => self
                    .dropped
                    .as_ref()
                    .map_or_else(|| value.clone(), |r| json!(r)),
                _ => value.clone(),
            };
            out.insert(key.clone(), value);
        }
        if with_timing && let Some(ms) = self.plugin_ms {
            out.insert("plugin_ms".into(), json!(ms));
        }
        if let Some(reason) = &self.dropped {
            out.insert("dropped".into(), json!(true));
            out.entry("reason").or_insert_with(|| json!(reason));
        }
        Value::Object(out)
    }
}

/// Accounts as `usage.media` shows them: a document's pages as one entry.
pub fn render(accounts: &[MediaAccount]) -> Vec<Value> {
    let mut out = Vec::with_capacity(accounts.len());
    let mut rest = accounts;
    while let Some(first) = rest.first() {
        let Some(page) = &first.page else {
            out.push(first.to_json(true));
            rest = &rest[1..];
            continue;
        };
        let pages = rest
            .iter()
            .take_while(|a| a.page.as_ref().is_some_and(|p| p.document == page.document))
            .count();
        out.push(document_json(&rest[..pages]));
        rest = &rest[pages..];
    }
    out
}

/// One document's entry: its page count, the pages kept, each page's size and tokens, and why
/// pages were shrunk or left out.
fn document_json(pages: &[MediaAccount]) -> Value {
    let of = |a: &MediaAccount| a.page.clone();
    let first = pages.first().and_then(of);
    let total = first.as_ref().map_or(0, |p| p.pages);
    let kept: Vec<u32> = pages.iter().filter_map(of).map(|p| p.page).collect();
    let shrunk = pages.iter().filter_map(of).filter(|p| p.shrunk).count();
    let mut reasons: Vec<String> = Vec::new();
    if shrunk > 0 {
        reasons.push(format!(
            "{shrunk} of the pages rendered smaller than documents.scale to fit the context"
        ));
    }
    if let Some(left_out) = first.as_ref().and_then(|p| p.left_out.as_deref()) {
        reasons.push(left_out.to_owned());
    }
    let per_page: Vec<Value> = pages
        .iter()
        .map(|a| {
            let page = a.page.as_ref().map_or(0, |p| p.page);
            let mut entry = json!({
                "page": page,
                "size": a.details.get("original_size"),
                "tokens": a.tokens,
            });
            if let Some(chars) = a.page.as_ref().and_then(|p| p.text_chars) {
                entry["text_chars"] = json!(chars);
            }
            if let Some(tokens) = a.page.as_ref().and_then(|p| p.text_tokens) {
                entry["text_tokens"] = json!(tokens);
            }
            if let Some(ms) = a.plugin_ms {
                entry["plugin_ms"] = json!(ms);
            }
            entry
        })
        .collect();
    let mut out = json!({
        "index": pages.first().map_or(0, |a| a.index),
        "kind": "document",
        "format": "pdf",
        "pages": total,
        "pages_kept": kept,
        "per_page": per_page,
        "tokens": pages.iter().map(|a| a.tokens).sum::<usize>(),
        "reduced": !reasons.is_empty() || pages.iter().any(|a| a.reduced),
    });
    let text_tokens: Vec<usize> = pages
        .iter()
        .filter_map(of)
        .filter_map(|p| p.text_tokens)
        .collect();
    if !text_tokens.is_empty() {
        out["text_tokens"] = json!(text_tokens.iter().sum::<usize>());
    }
    if !reasons.is_empty() {
        out["reason"] = json!(reasons.join("; "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_account_renders_its_report_with_the_typed_fields_and_a_drop_in_place() {
        let mut a = MediaAccount::embeddings(2, MediaKind::Image, 6);
        assert_eq!(
            serde_json::to_string(&a.to_json(true)).unwrap(),
            r#"{"index":2,"kind":"image","source":"image_embeds","tokens":6}"#
        );
        a.drop_for("the encoder failed");
        assert_eq!(
            serde_json::to_string(&a.to_json(true)).unwrap(),
            r#"{"index":2,"kind":"image","source":"image_embeds","tokens":0,"dropped":true,"reason":"encoding failed: the encoder failed"}"#
        );
        // A planned item's own reason is replaced where it stands.
        a.details.insert("reason".into(), json!("budget"));
        let rendered = serde_json::to_string(&a.to_json(false)).unwrap();
        assert!(
            rendered.contains(
                r#""tokens":0,"reason":"encoding failed: the encoder failed","dropped":true}"#
            ),
            "{rendered}"
        );
    }
}
