//! Text in and out of a model: the HF tokenizer (`tokenizer.json`), the chat template
//! (`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja` / `chat_template.json`)
//! rendered with minijinja as transformers renders it, and incremental detokenization for streaming.

use std::path::Path;

use serde::Serialize;
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// One part of a chat message's content, in the structure HF chat templates expect.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    Text(String),
    Image,
    Video,
    Audio,
}

impl Serialize for ContentPart {
    /// `{"type": "text", "text": ...}`, or `{"type": "image", "image": ""}` and so on: templates test
    /// either the type or the presence of a key named after it (Qwen2-Audio's tests
    /// `'audio' in content`), so media parts carry both.
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(2))?;
        let (kind, value) = match self {
            Self::Text(text) => ("text", text.as_str()),
            Self::Image => ("image", ""),
            Self::Video => ("video", ""),
            Self::Audio => ("audio", ""),
        };
        map.serialize_entry("type", kind)?;
        map.serialize_entry(kind, value)?;
        map.end()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Vec<ContentPart>,
}

impl ChatMessage {
    pub fn text(role: &str, text: &str) -> Self {
        Self {
            role: role.to_owned(),
            content: vec![ContentPart::Text(text.to_owned())],
        }
    }
}

/// A model directory's tokenizer and chat template.
pub struct TextProcessor {
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::Config {
            path: path.to_owned(),
            reason: e.to_string(),
        })
}

/// `tokenizer_config.json` writes special tokens as a string or as `{"content": ...}`.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        other => other.get("content")?.as_str().map(str::to_owned),
    }
}

impl TextProcessor {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&path).map_err(|e| Error::Config {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.is_file() {
            Some(std::fs::read_to_string(&jinja).map_err(|source| Error::Io {
                path: jinja,
                source,
            })?)
        } else if let Some(t) = config.get("chat_template").and_then(|t| t.as_str()) {
            Some(t.to_owned())
        } else {
            read_json(&dir.join("chat_template.json"))?.and_then(|v| {
                v.get("chat_template")
                    .and_then(|t| t.as_str())
                    .map(str::to_owned)
            })
        };
        Ok(Self {
            tokenizer,
            chat_template,
            bos_token: token_string(config.get("bos_token")),
            eos_token: token_string(config.get("eos_token")),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The id of the `eos_token` of `tokenizer_config.json`, if it names one.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Token ids of already templated text; special tokens written in it are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| Error::Input(format!("tokenizing: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether `text` surely makes more than `tokens` tokens wherever it stands in a prompt,
    /// found without tokenizing all of it: it is tokenized in pieces cut before whitespace, each
    /// piece's count taken less [`BOUNDARY_SLACK`] (what a merge across the cut could save), and
    /// the answer is known once the sum passes `tokens` (a text of megabytes meant for a context
    /// of thousands is refused after reading a few hundred kilobytes of it).
    pub fn surely_longer_than(&self, text: &str, tokens: usize) -> Result<bool> {
        let mut at_least = 0usize;
        let mut rest = text;
        while !rest.is_empty() {
            let piece = piece_before_whitespace(rest, COUNTING_PIECE_BYTES);
            rest = &rest[piece.len()..];
            let made = self
                .tokenizer
                .encode_fast(piece, false)
                .map_err(|e| Error::Input(format!("tokenizing: {e}")))?
                .len();
            at_least += made.saturating_sub(BOUNDARY_SLACK);
            if at_least > tokens {
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Input(format!("detokenizing: {e}")))
    }

    /// Renders the chat template (a model without one gets each message's text on its own line).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let Some(template) = &self.chat_template else {
            let mut out = String::new();
            for m in messages {
                for part in &m.content {
                    if let ContentPart::Text(text) = part {
                        out.push_str(text);
                        out.push('\n');
                    }
                }
            }
            return Ok(out);
        };
        let mut env = minijinja::Environment::new();
        // As transformers renders chat templates (and vLLM through it): a block tag's newline and
        // the spaces before it on its line are not output.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let render_err = |e: minijinja::Error| Error::Input(format!("chat template: {e}"));
        env.add_template("chat", template).map_err(render_err)?;
        let tmpl = env.get_template("chat").map_err(render_err)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(render_err)
    }

    /// A detokenizer that turns generated ids into text deltas as they arrive.
    pub fn stream(&self, skip_special_tokens: bool) -> TextStream {
        TextStream {
            skip_special_tokens,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// Bytes of text tokenized at a time by [`TextProcessor::surely_longer_than`].
const COUNTING_PIECE_BYTES: usize = 16 << 10;

/// Tokens a cut between two pieces of text may cost at most: pre-tokenizers split text before
/// whitespace, so a merge across a cut there joins at most the tokens either side of it.
const BOUNDARY_SLACK: usize = 2;

/// The start of `text` up to about `bytes`, cut before a whitespace character when there is one
/// in the second half (else at a character boundary): all of `text` when it is shorter.
fn piece_before_whitespace(text: &str, bytes: usize) -> &str {
    if text.len() <= bytes {
        return text;
    }
    // The nearest character boundary at or before `at` (a text's start is one).
    let boundary = |mut at: usize| {
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    let (half, end) = (boundary(bytes / 2), boundary(bytes));
    let cut = text[half..end]
        .rfind(char::is_whitespace)
        .map_or(end, |at| half + at);
    // Never nothing: the piece holds at least the first character, so counting moves on.
    &text[..cut.max(text.chars().next().map_or(0, char::len_utf8))]
}

/// Incremental detokenization state (holds no borrow of the tokenizer, so it can live in a
/// request). A delta is produced once the bytes decoded so far form whole characters.
pub struct TextStream {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl TextStream {
    /// The text `id` completes, if any.
    pub fn step(&mut self, text: &TextProcessor, id: u32) -> Result<Option<String>> {
        tokenizers::tokenizer::step_decode_stream(
            &text.tokenizer,
            vec![id],
            self.skip_special_tokens,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| Error::Input(format!("detokenizing: {e}")))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A template renders as transformers renders it: a block tag's newline (trim_blocks) and the
    /// indentation before a block tag (lstrip_blocks) are not output, as vLLM's prompts have them.
    #[test]
    fn templates_render_with_transformers_whitespace_rules() {
        let dir = tempfile::tempdir().unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/vllm/counts/llava/tokenizer.json");
        std::fs::copy(fixture, dir.path().join("tokenizer.json")).unwrap();
        let template = "{% for message in messages %}{{ message['role'] }}:\n  \
                        {% if true %}{{ message['content'][0]['text'] }}{% endif %}\n\
                        {% endfor %}end";
        let config = serde_json::json!({"chat_template": template});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let text = TextProcessor::load(dir.path()).unwrap();
        let rendered = text
            .apply_chat_template(&[ChatMessage::text("user", "hi")], false)
            .unwrap();
        // jinja2 with trim_blocks and lstrip_blocks (transformers' settings) renders this.
        assert_eq!(rendered, "user:\nhiend");
    }
}
