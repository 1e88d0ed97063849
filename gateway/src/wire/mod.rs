//! Formats on the wire: HTTP/1 framing of the passthrough lane, OpenAI's and Anthropic's request
//! and response shapes, and `torch.save` files (vLLM-style media embeddings).

pub mod anthropic;
pub mod http1;
pub mod openai;
pub mod torchfile;
