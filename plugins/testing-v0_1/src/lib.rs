//! A plugin exactly as one built in the 0.1 days: it imports `host@0.1.0` and exports
//! `plugin@0.1.0`. It accepts bytes starting with `LEGACY`, costs one token per byte after that, and
//! hands the bytes back as a u8 tensor, logging through the 0.1 host interface on the way.

wit_bindgen::generate!({
    world: "modality-plugin",
    path: "../../host-api/wit/v0.1",
});

use exports::mmgate::modality::plugin::Guest;
use mmgate::modality::host::{LogLevel, log};
use mmgate::modality::types::{
    Budget, Descriptor, Dtype, Media, MediaInfo, OverBudget, PluginError, Tensor, TokenPlan,
};

const MAGIC: &[u8] = b"LEGACY";

struct Legacy;

impl Guest for Legacy {
    fn describe() -> Descriptor {
        Descriptor {
            name: "legacy".into(),
            version: "0.1.0".into(),
            description: "built against contract 0.1".into(),
            modalities: vec!["legacy".into()],
            mime_types: vec!["*/*".into()],
            processor_types: vec![],
        }
    }

    fn probe(media: Media) -> Result<MediaInfo, PluginError> {
        if !media.data.starts_with(MAGIC) {
            return Err(PluginError::Unsupported("not a LEGACY item".into()));
        }
        log(LogLevel::Info, "probed a legacy item");
        Ok(MediaInfo {
            modality: "legacy".into(),
            format: "legacy".into(),
            width: None,
            height: None,
            frame_count: Some((media.data.len() - MAGIC.len()) as u64),
            fps: None,
            duration_seconds: None,
            sample_rate: None,
            channels: None,
            extra: vec![],
        })
    }

    fn plan(info: MediaInfo, budget: Budget, _config: String) -> Result<TokenPlan, PluginError> {
        let tokens = info.frame_count.unwrap_or(0) as u32;
        if tokens > budget.max_tokens {
            return Err(PluginError::OverBudget(OverBudget {
                needed_tokens: tokens,
                budget_tokens: budget.max_tokens,
                message: "one token per byte".into(),
            }));
        }
        Ok(TokenPlan {
            tokens,
            reduced: false,
            reason: "one token per byte".into(),
            choices: "{}".into(),
        })
    }

    fn preprocess(
        media: Media,
        _plan: TokenPlan,
        _config: String,
    ) -> Result<Vec<Tensor>, PluginError> {
        let data = media.data[MAGIC.len().min(media.data.len())..].to_vec();
        Ok(vec![Tensor {
            name: "bytes".into(),
            dtype: Dtype::U8,
            shape: vec![data.len() as u64],
            data,
        }])
    }
}

export!(Legacy);
