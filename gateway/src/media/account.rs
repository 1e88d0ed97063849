//! One media item's account: what `usage.media[i]` and the `x-mmgate-media` header say of it.
//! Typed where the gateway reads it back (metrics, the drop policy, the upstream rewrite) and
//! rendered to JSON in one place, with the plugin's report of the item (plugin, sizes, what the
//! plan chose and why) carried in its order.

use serde_json::{Map, Value, json};

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
            details,
        }
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

/// Accounts as `usage.media` shows them.
pub fn render(accounts: &[MediaAccount]) -> Vec<Value> {
    accounts.iter().map(|a| a.to_json(true)).collect()
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
