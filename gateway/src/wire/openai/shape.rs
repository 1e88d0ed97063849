//! How many messages and content parts a request holds, counted as the body is read and given up
//! as soon as either passes its limit: nothing of the request is built. A body of a million empty
//! parts costs a full parse hundreds of megabytes before any check could see it; counted here it
//! costs a scan of the first parts past the limit.
//!
//! Chat's `messages` and the Responses API's `input` share a shape (a list of items, each with a
//! `content` that is a string or a list of parts), so one counter serves both. Anything else in the
//! body, and anything not shaped as expected, is skipped: the real parser judges it.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The most items and parts a request may hold.
#[derive(Debug, Clone, Copy)]
pub struct ShapeLimits {
    /// Items of the list (chat's messages, Responses' input items).
    pub max_messages: usize,
    /// Content parts of all items together.
    pub max_content_parts: usize,
}

/// Why a body's shape is refused.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error("{list} holds more than {limit} items (limits.max_messages)")]
    TooManyMessages { list: &'static str, limit: usize },
    #[error("{list} holds more than {limit} content parts in all (limits.max_content_parts)")]
    TooManyParts { list: &'static str, limit: usize },
    /// The body is not JSON (its error, as the parser put it).
    #[error("{0}")]
    Json(serde_json::Error),
}

/// Counts the items of the body's `list` field (`messages` or `input`) and their content parts.
pub fn check(body: &[u8], list: &'static str, limits: ShapeLimits) -> Result<(), ShapeError> {
    let counter = Counter {
        limits,
        list,
        messages: Cell::new(0),
        parts: Cell::new(0),
        exceeded: Cell::new(None),
    };
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let scanned = Seed {
        counter: &counter,
        level: Level::Body,
    }
    .deserialize(&mut deserializer)
    .and_then(|()| deserializer.end());
    match (counter.exceeded.take(), scanned) {
        (Some(exceeded), _) => Err(exceeded),
        (None, Ok(())) => Ok(()),
        (None, Err(e)) => Err(ShapeError::Json(e)),
    }
}

/// Counts the items of a list that has been parsed already (a conversation made of kept turns and
/// a new input).
pub fn check_values(
    items: &[serde_json::Value],
    list: &'static str,
    limits: ShapeLimits,
) -> Result<(), ShapeError> {
    if items.len() > limits.max_messages {
        return Err(ShapeError::TooManyMessages {
            list,
            limit: limits.max_messages,
        });
    }
    let parts: usize = items
        .iter()
        .filter_map(|item| item.get("content")?.as_array().map(Vec::len))
        .sum();
    if parts > limits.max_content_parts {
        return Err(ShapeError::TooManyParts {
            list,
            limit: limits.max_content_parts,
        });
    }
    Ok(())
}

struct Counter {
    limits: ShapeLimits,
    list: &'static str,
    messages: Cell<usize>,
    parts: Cell<usize>,
    exceeded: Cell<Option<ShapeError>>,
}

impl Counter {
    fn count<E: de::Error>(&self, level: Level) -> Result<(), E> {
        let (cell, limit) = match level {
            Level::Item => (&self.messages, self.limits.max_messages),
            _ => (&self.parts, self.limits.max_content_parts),
        };
        cell.set(cell.get() + 1);
        if cell.get() <= limit {
            return Ok(());
        }
        let list = self.list;
        self.exceeded.set(Some(match level {
            Level::Item => ShapeError::TooManyMessages { list, limit },
            _ => ShapeError::TooManyParts { list, limit },
        }));
        Err(E::custom("over the limit"))
    }
}

/// Where in the body a value stands.
#[derive(Clone, Copy, PartialEq)]
enum Level {
    /// The body: an object whose `list` field holds the items.
    Body,
    /// The list of items (or a string: Responses' `input` may be one).
    List,
    /// One item: an object whose `content` holds its parts.
    Item,
    /// An item's content: a string, or a list of parts.
    Content,
}

#[derive(Clone, Copy)]
struct Seed<'c> {
    counter: &'c Counter,
    level: Level,
}

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// Values of a type other than the one looked for are skipped: the real parser judges them.
macro_rules! skip_scalars {
    ($($name:ident: $ty:ty),*) => {
        $(fn $name<E: de::Error>(self, _: $ty) -> Result<(), E> { Ok(()) })*
    };
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    skip_scalars!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let element = match self.level {
            Level::List => Level::Item,
            Level::Content => Level::Content,
            Level::Body | Level::Item => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return Ok(());
            }
        };
        loop {
            if element == Level::Item {
                if seq
                    .next_element_seed(Seed {
                        counter: self.counter,
                        level: Level::Item,
                    })?
                    .is_none()
                {
                    return Ok(());
                }
                self.counter.count(Level::Item)?;
            } else {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Ok(());
                }
                self.counter.count(Level::Content)?;
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (wanted, inner) = match self.level {
            Level::Body => (self.counter.list, Level::List),
            Level::Item => ("content", Level::Content),
            Level::List | Level::Content => {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                return Ok(());
            }
        };
        while let Some(is_wanted) = map.next_key_seed(KeyIs(wanted))? {
            if is_wanted {
                map.next_value_seed(Seed {
                    counter: self.counter,
                    level: inner,
                })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Whether a key is the one looked for, read without copying it.
struct KeyIs(&'static str);

impl<'de> DeserializeSeed<'de> for KeyIs {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        Ok(key == self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ShapeLimits = ShapeLimits {
        max_messages: 3,
        max_content_parts: 4,
    };

    fn checked(body: &str, list: &'static str) -> Result<(), ShapeError> {
        check(body.as_bytes(), list, LIMITS)
    }

    #[test]
    fn messages_and_parts_are_counted_up_to_their_limits() {
        let part = r#"{"type":"text","text":"x"}"#;
        let parts = |n: usize| vec![part; n].join(",");
        let message = |n: usize| format!(r#"{{"role":"user","content":[{}]}}"#, parts(n));
        let body = |messages: &[String]| {
            format!(
                r#"{{"model":"m","messages":[{}],"n":1}}"#,
                messages.join(",")
            )
        };
        assert!(checked(&body(&[message(2), message(2)]), "messages").is_ok());
        assert!(matches!(
            checked(&body(&[message(2), message(3)]), "messages"),
            Err(ShapeError::TooManyParts { limit: 4, .. })
        ));
        let text = r#"{"role":"user","content":"hi"}"#.to_owned();
        assert!(checked(&body(&vec![text.clone(); 3]), "messages").is_ok());
        assert!(matches!(
            checked(&body(&vec![text; 4]), "messages"),
            Err(ShapeError::TooManyMessages { limit: 3, .. })
        ));
    }

    #[test]
    fn the_responses_input_is_counted_and_other_shapes_are_left_to_the_parser() {
        let input = r#"{"model":"m","input":[{"role":"user","content":[1,2,3,4,5]}]}"#;
        assert!(matches!(
            checked(input, "input"),
            Err(ShapeError::TooManyParts { list: "input", .. })
        ));
        // The same body's `messages` (absent) holds nothing.
        assert!(checked(input, "messages").is_ok());
        for odd in [
            r#"{"input":"just text"}"#,
            r#"{"input":[1,null,[[]]]}"#,
            r#"[1,2,3,4,5,6]"#,
            r#"{"input":[{"content":{"a":[1,2,3,4,5]}}]}"#,
        ] {
            assert!(checked(odd, "input").is_ok(), "{odd}");
        }
        assert!(matches!(
            checked(r#"{"input":["#, "input"),
            Err(ShapeError::Json(_))
        ));
    }

    #[test]
    fn a_million_parts_stop_at_the_limit() {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{}]}}]}}"#,
            vec!["{}"; 1_000_000].join(",")
        );
        let limits = ShapeLimits {
            max_messages: 10,
            max_content_parts: 100,
        };
        assert!(matches!(
            check(body.as_bytes(), "messages", limits),
            Err(ShapeError::TooManyParts { limit: 100, .. })
        ));
    }
}
