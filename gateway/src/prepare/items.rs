//! What a chat request's preparation works with: the services it needs besides its model, and
//! its media items once resolved (each a plugin's input or embeddings; a document's pages are
//! items too).

use std::sync::Arc;

use mmgate_host::{LoadedPlugin, Media, PluginPool, PluginRegistry};
use mmgate_inference::engine::MediaItem;
use mmgate_inference::families::MediaKind;

use crate::config::RequestLimits;
use crate::media::documents::{DocumentsConfig, PageOf};
use crate::media::files::FileStore;
use crate::store::Caller;

/// What a chat request needs besides its model.
pub struct ChatServices<'a> {
    /// Whose request it is: uploads are looked up as theirs.
    pub caller: &'a Caller,
    pub registry: Arc<PluginRegistry>,
    pub pool: &'a PluginPool,
    pub limits: &'a RequestLimits,
    pub files: &'a FileStore,
    pub fetcher: &'a crate::media::fetch::Fetcher,
    pub documents: &'a DocumentsConfig,
}

/// One media part of the request, resolved: bytes for a plugin, or embeddings ready to merge.
pub(crate) struct Item {
    pub(crate) kind: MediaKind,
    pub(crate) input: ItemInput,
    /// The page of a document this item is, when it is one.
    pub(crate) page: Option<PageOf>,
}

pub(crate) enum ItemInput {
    Plugin {
        plugin: Arc<LoadedPlugin>,
        media: Arc<Media>,
    },
    /// Encoded elsewhere (an `image_embeds` part): a fixed number of tokens, nothing to run.
    Embeddings(MediaItem),
}
