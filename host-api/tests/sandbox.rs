//! Hostile plugins against the real sandbox. Each test fails if the limit it exercises were removed:
//! without a deadline `spin` never returns (the watchdog below fails the test), without a memory cap
//! `grow` would end as a plain trap or exhaust the machine, and so on.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use mmgate_host::builtin::artifact_dir;
use mmgate_host::{
    Budget, CallError, DeadlineClock, Dtype, LoadedPlugin, Media, PluginError, PluginOrigin,
    PluginPool, Sandbox, SandboxLimits, TokenPlan,
};

const MEMORY: usize = 64 << 20;
const OUTPUT: usize = 8 << 20;
const DEADLINE_MS: u64 = 300;
/// How long a call may take before the watchdog declares the sandbox broken. Far above the deadline,
/// so a slow machine never fails the test; a missing deadline always does.
const WATCHDOG: Duration = Duration::from_secs(60);

fn limits() -> SandboxLimits {
    SandboxLimits {
        memory_bytes: MEMORY,
        deadline_ms: DEADLINE_MS,
        max_output_bytes: OUTPUT,
        max_wasm_stack: 512 << 10,
        max_instances: 16,
        ..SandboxLimits::default()
    }
}

fn test_plugin() -> Arc<LoadedPlugin> {
    testing_plugin_with(limits())
}

fn testing_plugin_with(limits: SandboxLimits) -> Arc<LoadedPlugin> {
    let sandbox = Arc::new(Sandbox::new(limits).expect("sandbox"));
    let path = artifact_dir().join("testing.wasm");
    let bytes = std::fs::read(&path).expect("the build script builds testing.wasm");
    Arc::new(LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).expect("load"))
}

fn media(command: &[u8]) -> Media {
    Media {
        data: command.to_vec(),
        mime_type: Some("application/x-mmgate-test".into()),
    }
}

fn plan() -> TokenPlan {
    TokenPlan {
        tokens: 1,
        reduced: false,
        reason: String::new(),
        choices: "{}".into(),
    }
}

/// Run `preprocess(command)` on another thread and fail the test if it does not end in time.
fn preprocess(
    plugin: &Arc<LoadedPlugin>,
    command: &[u8],
) -> Result<Vec<mmgate_host::Tensor>, CallError> {
    let (tx, rx) = mpsc::channel();
    let plugin = plugin.clone();
    let media = media(command);
    std::thread::spawn(move || {
        let _ = tx.send(plugin.preprocess(&media, &plan(), "{}"));
    });
    rx.recv_timeout(WATCHDOG).unwrap_or_else(|_| {
        panic!(
            "preprocess({:?}) did not end within {WATCHDOG:?}: the sandbox failed to stop it",
            String::from_utf8_lossy(command)
        )
    })
}

fn assert_healthy(plugin: &Arc<LoadedPlugin>) {
    let payload = b"echo: still alive".to_vec();
    let tensors = preprocess(plugin, &payload).expect("a healthy call after a hostile one");
    assert_eq!(tensors.len(), 1);
    assert_eq!(tensors[0].data, payload);
    assert_eq!(tensors[0].dtype, Dtype::U8);
}

#[test]
fn endless_loop_is_stopped_by_the_deadline() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"spin").unwrap_err();
    assert!(
        matches!(&error, CallError::Deadline(passed)
            if passed.limit == limits().deadline_for(plan().tokens)
                && passed.clock == DeadlineClock::PluginCpu
                && passed.call == "preprocess"
                && passed.plugin == "testing"),
        "{error:?}"
    );
    assert_healthy(&plugin);
}

/// A call that makes a plan's tokens gets time for them on top of the deadline.
#[test]
fn the_deadline_grows_with_the_tokens_a_call_makes() {
    let limits = SandboxLimits {
        deadline_ms: 10_000,
        deadline_ms_per_1000_tokens: 1_000,
        ..SandboxLimits::default()
    };
    assert_eq!(limits.deadline_for(0), Duration::from_secs(10));
    assert_eq!(limits.deadline_for(30_000), Duration::from_secs(40));
    assert!(limits.deadline_for(u32::MAX) > limits.deadline_for(30_000));
}

/// The deadline is the plugin's own CPU time: a call whose thread waits (as on a machine whose
/// cores other work holds) is not stopped for the wall-clock time that passes meanwhile; the
/// wall-clock deadline, far larger, still stops a call that never gets anywhere.
#[test]
fn waiting_off_the_cpu_is_not_the_deadline_but_the_wall_clock_backstop_is() {
    let plugin = test_plugin();
    let waits = format!("sleep:{}", DEADLINE_MS * 3);
    let tensors = preprocess(&plugin, waits.as_bytes()).expect("a call that only waited");
    assert_eq!(tensors[0].name, "slept");
    assert_eq!(plugin.deadlines_passed(), 0);

    let plugin = testing_plugin_with(SandboxLimits {
        wall_deadline_ms: DEADLINE_MS,
        ..limits()
    });
    let error = preprocess(&plugin, waits.as_bytes()).unwrap_err();
    assert!(
        matches!(&error, CallError::Deadline(passed)
            if passed.clock == DeadlineClock::Wall && passed.spent >= Duration::from_millis(DEADLINE_MS)),
        "{error:?}"
    );
    assert_eq!(plugin.deadlines_passed(), 1);
    assert_healthy(&plugin);
}

#[test]
fn unbounded_allocation_hits_the_memory_cap() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"grow").unwrap_err();
    assert!(
        matches!(error, CallError::Memory { limit } if limit == MEMORY),
        "{error:?}"
    );
    assert_healthy(&plugin);
}

#[test]
fn unbounded_recursion_overflows_the_wasm_stack_only() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"recurse").unwrap_err();
    assert!(
        matches!(&error, CallError::Trap(m) if m.contains("stack overflow")),
        "{error:?}"
    );
    assert_healthy(&plugin);
    let error = preprocess(&plugin, b"recurse-shadow").unwrap_err();
    assert!(matches!(&error, CallError::Trap(_)), "{error:?}");
    assert_healthy(&plugin);
}

#[test]
fn output_over_the_cap_is_refused() {
    let plugin = test_plugin();
    let command = format!("huge:{}", OUTPUT + 1);
    let error = preprocess(&plugin, command.as_bytes()).unwrap_err();
    assert!(
        matches!(error, CallError::OutputTooLarge { size, limit } if size == OUTPUT + 1 && limit == OUTPUT),
        "{error:?}"
    );
    // Far past the cap, the copy out of the guest is cut off early, with the same error.
    let far = format!("huge:{}", OUTPUT + (32 << 20));
    let error = preprocess(&plugin, far.as_bytes()).unwrap_err();
    assert!(
        matches!(error, CallError::OutputTooLarge { size, limit } if size > OUTPUT && limit == OUTPUT),
        "{error:?}"
    );
    // Exactly at the cap is fine.
    let at_cap = format!("huge:{OUTPUT}");
    let tensors = preprocess(&plugin, at_cap.as_bytes()).expect("output at the cap");
    assert_eq!(tensors[0].data.len(), OUTPUT);
}

#[test]
fn a_panic_is_a_trap_of_that_call_only() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"trap").unwrap_err();
    assert!(matches!(error, CallError::Trap(_)), "{error:?}");
    assert_healthy(&plugin);
}

#[test]
fn a_tensor_whose_bytes_do_not_match_its_shape_breaks_the_contract() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"malformed").unwrap_err();
    assert!(
        matches!(&error, CallError::Contract(m) if m.contains("needs 400 bytes but carries 3")),
        "{error:?}"
    );
}

#[test]
fn typed_plugin_errors_arrive_with_their_message() {
    let plugin = test_plugin();
    let error = preprocess(&plugin, b"fail").unwrap_err();
    assert!(
        matches!(&error, CallError::Plugin(PluginError::InvalidMedia(m)) if m.contains("asked to fail")),
        "{error:?}"
    );
    let budget_error = plugin
        .plan(
            &plugin.probe(&media(b"x")).expect("probe"),
            Budget { max_tokens: 0 },
            "{}",
        )
        .unwrap_err();
    assert!(
        matches!(&budget_error, CallError::Plugin(PluginError::OverBudget(o)) if o.needed_tokens == 1),
        "{budget_error:?}"
    );
}

#[test]
fn the_sandbox_has_no_files_environment_or_arguments() {
    // Give this process some environment a leaky sandbox would pass on.
    assert!(std::env::vars().count() > 0);
    let plugin = test_plugin();
    let tensors = preprocess(&plugin, b"escape").expect("escape probe");
    let seen: Vec<i64> = tensors[0]
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(seen, vec![-1, 0, 0], "[root entries, env vars, args]");
}

#[test]
fn hostile_calls_do_not_disturb_concurrent_healthy_calls() {
    let plugin = test_plugin();
    let healthy: Vec<_> = (0..3)
        .map(|worker| {
            let plugin = plugin.clone();
            std::thread::spawn(move || {
                for i in 0..20 {
                    let payload = format!("echo {worker}-{i}").into_bytes();
                    let out = plugin
                        .preprocess(&media(&payload), &plan(), "{}")
                        .expect("healthy call next to hostile ones");
                    assert_eq!(out[0].data, payload);
                }
            })
        })
        .collect();
    for command in [&b"spin"[..], b"grow", b"recurse", b"trap", b"spin"] {
        assert!(preprocess(&plugin, command).is_err());
    }
    for worker in healthy {
        worker.join().expect("healthy worker");
    }
}

#[test]
fn a_full_pool_refuses_instead_of_queueing_without_bound() {
    let plugin = test_plugin();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pool = Arc::new(PluginPool::new(1, 1, 0).unwrap());
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let busy = {
            let (pool, plugin) = (pool.clone(), plugin.clone());
            tokio::spawn(async move {
                pool.run(move || {
                    let _ = started_tx.send(());
                    plugin.preprocess(&media(b"spin"), &plan(), "{}")
                })
                .await
            })
        };
        started_rx.await.unwrap();
        // The worker is busy: one call may wait, the next is refused at once.
        let queued = {
            let (pool, plugin) = (pool.clone(), plugin.clone());
            tokio::spawn(async move {
                pool.run(move || plugin.preprocess(&media(b"echo"), &plan(), "{}"))
                    .await
            })
        };
        while pool.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let refused = pool.run(|| Ok(())).await;
        assert!(
            matches!(refused, Err(CallError::Overloaded { queued: 1 })),
            "{refused:?}"
        );
        assert!(matches!(busy.await.unwrap(), Err(CallError::Deadline(_))));
        assert_eq!(queued.await.unwrap().unwrap()[0].data, b"echo");
    });
}

#[test]
fn a_plugin_built_against_contract_0_1_is_still_served() {
    let sandbox = Arc::new(Sandbox::new(limits()).unwrap());
    let path = artifact_dir().join("testing-v0_1.wasm");
    let bytes = std::fs::read(&path).unwrap();
    let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).unwrap();
    assert_eq!(plugin.contract_version().to_string(), "0.1.0");
    assert_eq!(plugin.name(), "legacy");
    let item = Media {
        data: b"LEGACYabc".to_vec(),
        mime_type: None,
    };
    // probe logs through the 0.1 host interface.
    let info = plugin.probe(&item).unwrap();
    let plan = plugin.plan(&info, Budget { max_tokens: 10 }, "{}").unwrap();
    assert_eq!(plan.tokens, 3);
    let tensors = plugin.preprocess(&item, &plan, "{}").unwrap();
    assert_eq!(tensors[0].data, b"abc");
    match plugin.plan(&info, Budget { max_tokens: 2 }, "{}") {
        Err(CallError::Plugin(PluginError::OverBudget(o))) => assert_eq!(o.needed_tokens, 3),
        other => panic!("expected over-budget, got {other:?}"),
    }
}

/// Parts (contract 0.4) within the host's caps: at most `MAX_PARTS` of them, and together no
/// larger than one call's output.
#[test]
fn an_items_parts_are_capped_in_number_and_in_bytes_together() {
    let plugin = testing_plugin_with(SandboxLimits {
        max_output_bytes: 1000,
        ..limits()
    });
    let run = |command: &str| {
        let item = media(command.as_bytes());
        let info = plugin.probe(&item).unwrap();
        let plan = plugin.plan(&info, Budget { max_tokens: 10 }, "{}").unwrap();
        let parts = plugin.parts(&plan, "{}")?;
        let made = (0..parts)
            .map(|i| plugin.preprocess_part(&item, &plan, "{}", i))
            .collect::<Result<Vec<_>, _>>()?;
        plugin.check_parts_output(&made).map(|()| made)
    };
    let made = run("parts:3:300").unwrap();
    assert_eq!(made.len(), 3);
    assert_eq!(made[2][0].data, vec![2u8; 300]);
    // Each part fits one call's cap; together they do not (300 bytes and a 1-byte index each).
    assert!(matches!(
        run("parts:4:300"),
        Err(CallError::OutputTooLarge {
            size: 1204,
            limit: 1000
        })
    ));
    assert!(matches!(run("parts:0:1"), Err(CallError::Contract(_))));
    assert!(matches!(run("parts:5000:1"), Err(CallError::Contract(_))));
}

#[test]
fn parts_placed_beforehand_are_held_to_their_part_plans() {
    let plugin = test_plugin();
    let item = media(b"parts:3:10");
    let info = plugin.probe(&item).unwrap();
    let plan = plugin.plan(&info, Budget { max_tokens: 10 }, "{}").unwrap();
    let plans = plugin.part_plans(&plan, "{}", 3).unwrap().unwrap();
    assert_eq!(
        plans.iter().map(|p| p.tokens).collect::<Vec<_>>(),
        [plan.tokens, 0, 0]
    );
    for (index, part_plan) in plans.iter().enumerate() {
        let part = plugin
            .preprocess_planned_part(&item, &plan, "{}", index as u32, part_plan)
            .unwrap();
        assert_eq!(part[0].data, vec![index as u8; 10]);
    }
    // A part unlike its plan (here: part 1 under part 0's) is refused.
    assert!(matches!(
        plugin.preprocess_planned_part(&item, &plan, "{}", 1, &plans[0]),
        Err(CallError::Contract(m)) if m.contains("index")
    ));
    // Plans for another count of parts are refused.
    assert!(matches!(
        plugin.part_plans(&plan, "{}", 4),
        Err(CallError::Contract(_))
    ));
}

#[test]
fn a_plugin_built_against_contract_0_4_is_still_served_in_parts_placed_once_made() {
    let sandbox = Arc::new(Sandbox::new(limits()).unwrap());
    let path = artifact_dir().join("testing-v0_4.wasm");
    let bytes = std::fs::read(&path).unwrap();
    let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).unwrap();
    assert_eq!(plugin.contract_version().to_string(), "0.4.1");
    let photo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/image/images/photo-640x480.jpg");
    let item = Media {
        data: std::fs::read(photo).unwrap(),
        mime_type: Some("image/jpeg".into()),
    };
    let info = plugin.probe(&item).unwrap();
    let plan = plugin
        .plan(&info, Budget { max_tokens: 480 }, "{}")
        .unwrap();
    let whole = plugin.preprocess(&item, &plan, "{}").unwrap();
    // Its parts go through 0.4.1's row decoder, and are the whole's rows.
    assert_eq!(plugin.parts(&plan, "{}").unwrap(), 2);
    let parts: Vec<u8> = (0..2)
        .flat_map(|i| {
            let part = plugin.preprocess_part(&item, &plan, "{}", i).unwrap();
            assert_eq!(part[0].shape, [240, 640, 3]);
            part[0].data.clone()
        })
        .collect();
    assert!(parts == whole[0].data);
    // 0.4 has no part plans: its parts are placed once made.
    assert!(plugin.part_plans(&plan, "{}", 2).unwrap().is_none());
}

#[test]
fn a_plugin_built_against_contract_0_3_is_still_served_whole_with_its_image_decoder() {
    let sandbox = Arc::new(Sandbox::new(limits()).unwrap());
    let path = artifact_dir().join("testing-v0_3.wasm");
    let bytes = std::fs::read(&path).unwrap();
    let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).unwrap();
    assert_eq!(plugin.contract_version().to_string(), "0.3.1");
    let photo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/image/images/photo-640x480.jpg");
    let item = Media {
        data: std::fs::read(photo).unwrap(),
        mime_type: Some("image/jpeg".into()),
    };
    // probe and preprocess go through the 0.3 image decoder; reduce is 0.3's.
    let info = plugin.probe(&item).unwrap();
    assert_eq!((info.width, info.height), (Some(640), Some(480)));
    let plan = plugin
        .plan(&info, Budget { max_tokens: 480 }, "{}")
        .unwrap();
    let whole = plugin.preprocess(&item, &plan, "{}").unwrap();
    assert_eq!(whole[0].shape, [480, 640, 3]);
    assert_eq!(
        plugin.reduce(&item, &plan, "{}").unwrap().files[0].data,
        item.data
    );
    // 0.3 has no parts: its items are one part, the whole.
    assert_eq!(plugin.parts(&plan, "{}").unwrap(), 1);
    let part = plugin.preprocess_part(&item, &plan, "{}", 0).unwrap();
    assert_eq!(
        (&part[0].shape, &part[0].data),
        (&whole[0].shape, &whole[0].data)
    );
    assert!(matches!(
        plugin.preprocess_part(&item, &plan, "{}", 1),
        Err(CallError::Contract(_))
    ));
}

#[test]
fn a_plugin_built_against_contract_0_2_is_still_served_with_its_video_decoder() {
    let sandbox = Arc::new(Sandbox::new(limits()).unwrap());
    let path = artifact_dir().join("testing-v0_2.wasm");
    let bytes = std::fs::read(&path).unwrap();
    let plugin = LoadedPlugin::load(sandbox, &bytes, PluginOrigin::File(path)).unwrap();
    assert_eq!(plugin.contract_version().to_string(), "0.2.0");
    let clip = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/video/clips/h264.mp4");
    let item = Media {
        data: std::fs::read(clip).unwrap(),
        mime_type: Some("video/mp4".into()),
    };
    // probe and preprocess go through the 0.2 video-decoder.
    let info = plugin.probe(&item).unwrap();
    let (width, height) = (info.width.unwrap(), info.height.unwrap());
    assert!(info.frame_count.unwrap() > 0, "{info:?}");
    let plan = plugin.plan(&info, Budget { max_tokens: 10 }, "{}").unwrap();
    let tensors = plugin.preprocess(&item, &plan, "{}").unwrap();
    assert_eq!(tensors[0].shape, [u64::from(height), u64::from(width), 3]);
    // 0.2 has no reduce: the host says so instead of calling it.
    match plugin.reduce(&item, &plan, "{}") {
        Err(CallError::Plugin(PluginError::Unsupported(m))) => {
            assert!(m.contains("0.2.0") && m.contains("reduce"), "{m}")
        }
        other => panic!("expected unsupported, got {other:?}"),
    }
}
