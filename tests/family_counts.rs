//! The image plugin's token counts for the families planned in front of an engine, against
//! transformers' processors over many image sizes (tests/fixtures/vllm/counts.py, made with the
//! transformers vLLM 0.32 runs): each family's checkpoint configs give the processor config the
//! plugin gets, with what the family adds from `config.json`, as a served model's and
//! `mmgate preprocess`'s; every size's plan must count what the processor wrote. No engine runs
//! here: tests/vllm.rs checks a few of these counts against vLLM itself.

use std::path::Path;
use std::sync::Arc;

use mmgate_host::{Budget, MediaInfo, PluginRegistry, Sandbox, SandboxLimits};
use serde::Deserialize;

#[derive(Deserialize)]
struct Counts {
    transformers: String,
    families: std::collections::BTreeMap<String, Vec<Case>>,
}

#[derive(Deserialize)]
struct Case {
    width: u32,
    height: u32,
    tokens: u32,
}

#[test]
fn the_image_plugin_counts_as_transformers_for_every_upstream_family() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm/counts");
    let counts: Counts =
        serde_json::from_slice(&std::fs::read(root.join("counts.json")).unwrap()).unwrap();
    assert!(counts.families.len() >= 8, "the fixture set is incomplete");
    let sandbox = Arc::new(Sandbox::new(SandboxLimits::default()).unwrap());
    let registry = PluginRegistry::builtin(&sandbox).unwrap();
    let plugin = registry.for_modality("image").unwrap();
    println!(
        "image token counts against transformers {}",
        counts.transformers
    );
    let mut failures = Vec::new();
    for (family, cases) in &counts.families {
        let config = mmgate_inference::prompt::plugin_processor_config(&root.join(family))
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        for case in cases {
            let plan = plugin.plan(
                &MediaInfo::image("png", case.width, case.height),
                Budget {
                    max_tokens: u32::MAX,
                },
                &config,
            );
            match plan {
                Ok(plan) if plan.tokens == case.tokens && !plan.reduced => {}
                Ok(plan) => failures.push(format!(
                    "{family} {}x{}: {} tokens, transformers {} ({})",
                    case.width, case.height, plan.tokens, case.tokens, plan.reason
                )),
                Err(e) => failures.push(format!("{family} {}x{}: {e:?}", case.width, case.height)),
            }
        }
        println!("{family:<16} {} sizes", cases.len());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
