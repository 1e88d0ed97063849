//! A request's media parts as they go upstream: found in the order chat processing takes them, and
//! each replaced, dropped or kept as the route that served the model decided.

use serde_json::Value;

/// What becomes of one media part.
pub enum Rewrite {
    /// The part goes as this one instead (embeddings, media as planned).
    Replace(Value),
    /// The part leaves the request (the model's encode-error policy dropped it).
    Drop,
    /// The part goes as it came.
    Keep,
}

/// The request's media parts, in the order chat processing takes them.
pub fn media_parts(body: &Value) -> impl Iterator<Item = &Value> {
    body.get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|part| is_media(part))
}

/// Every part but text is media (parts of unknown types never get this far: parsing the request
/// refused them).
fn is_media(part: &Value) -> bool {
    part.get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "text")
}

/// Replaces the body's media parts, in order, as `rewrites` say (parts past the end are kept).
pub fn rewrite(body: &mut Value, rewrites: Vec<Rewrite>) {
    let mut rewrites = rewrites.into_iter();
    let messages = body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten();
    for message in messages {
        let Some(parts) = message.get_mut("content").and_then(Value::as_array_mut) else {
            continue;
        };
        let mut kept = Vec::with_capacity(parts.len());
        for part in parts.drain(..) {
            if !is_media(&part) {
                kept.push(part);
                continue;
            }
            match rewrites.next() {
                Some(Rewrite::Replace(new)) => kept.push(new),
                Some(Rewrite::Drop) => {}
                Some(Rewrite::Keep) | None => kept.push(part),
            }
        }
        *parts = kept;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn media_parts_are_rewritten_in_order_and_dropped_ones_leave() {
        let image = |n: u8| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{n}")}});
        let mut body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image(1), {"type": "text", "text": "and"}, image(2)]},
            {"role": "user", "content": [image(3), image(4)]},
        ]});
        assert_eq!(media_parts(&body).count(), 4);
        rewrite(
            &mut body,
            vec![
                Rewrite::Drop,
                Rewrite::Replace(json!({"type": "x"})),
                Rewrite::Keep,
            ],
        );
        assert_eq!(body["messages"][0]["content"], "be brief");
        assert_eq!(
            body["messages"][1]["content"],
            json!([{"type": "text", "text": "and"}, {"type": "x"}])
        );
        assert_eq!(body["messages"][2]["content"], json!([image(3), image(4)]));
    }
}
