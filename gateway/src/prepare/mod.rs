//! A chat request made ready for a model whose files this gateway holds, whether it runs the
//! model or plans for an upstream engine: the request checked, its media resolved within the limits
//! ([`media`]; the [`items`] it makes), a document's pages sized and rendered ([`documents`]), its
//! text checked and templated ([`prompt_text`]), its items run through their
//! plugins under the request-wide budget ([`gather`]), and the plugins' tensors turned into the
//! inference core's values ([`plugin_output`]). The engine's side of it is `native`'s; what an
//! upstream is sent, `api::media_modes`'.

mod bands;
pub mod documents;
pub mod errors;
pub mod gather;
pub mod items;
pub mod media;
pub mod plugin_output;
pub mod prompt_text;
