//! One loaded plugin: its compiled component, pre-linked once, and the calls into it. Each call
//! instantiates into a fresh `Store` (from the pooling allocator), so nothing survives between calls
//! and a failed call cannot poison the next one.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::{Store, Trap, UpdateDeadline};

use crate::contract::{
    Budget, CONTRACT_VERSION, Descriptor, Media, MediaInfo, ModalityPlugin, ModalityPluginPre,
    PLUGIN_INTERFACE, PartPlan, PluginError, ReducedItem, SUPPORTED_VERSIONS, Tensor, TokenPlan,
    Version, v0_1, v0_2, v0_3, v0_4,
};
use crate::error::{CallError, LoadError};
use crate::sandbox::{CallState, Sandbox};

/// Where a plugin came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginOrigin {
    /// Embedded in the binary.
    Builtin,
    /// Loaded from a file (a plugin directory, or `mmgate plugin check`).
    File(PathBuf),
}

impl std::fmt::Display for PluginOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PluginOrigin::Builtin => f.write_str("built-in"),
            PluginOrigin::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Most parts one item may be made in: the host runs a call for each (a 768-frame video in the
/// built-in plugin's runs of 2, then up to 8 temporal patches is 49).
pub const MAX_PARTS: u32 = 1024;

/// A component pre-linked against the bindings of the contract version it was built for.
enum Pre {
    Current(ModalityPluginPre<CallState>),
    V0_4(v0_4::ModalityPluginPre<CallState>),
    V0_3(v0_3::ModalityPluginPre<CallState>),
    V0_2(v0_2::ModalityPluginPre<CallState>),
    V0_1(v0_1::ModalityPluginPre<CallState>),
}

/// An instance of any served version. All export describe, probe, plan and preprocess over the same
/// Rust types; 0.3 and later have `reduce`, 0.4 and later `parts` and `preprocess-part`, only the
/// current one `part-plans`.
enum Instance {
    Current(ModalityPlugin),
    V0_4(v0_4::ModalityPlugin),
    V0_3(v0_3::ModalityPlugin),
    V0_2(v0_2::ModalityPlugin),
    V0_1(v0_1::ModalityPlugin),
}

/// Call an export every contract version has, of whichever version `$instance` speaks.
macro_rules! on_plugin {
    ($instance:expr, |$exports:ident| $call:expr) => {
        match $instance {
            Instance::Current(p) => {
                let $exports = p.mmgate_modality_plugin();
                $call
            }
            Instance::V0_4(p) => {
                let $exports = p.mmgate_modality_plugin();
                $call
            }
            Instance::V0_3(p) => {
                let $exports = p.mmgate_modality_plugin();
                $call
            }
            Instance::V0_2(p) => {
                let $exports = p.mmgate_modality_plugin();
                $call
            }
            Instance::V0_1(p) => {
                let $exports = p.mmgate_modality_plugin();
                $call
            }
        }
    };
}

/// A plugin ready to be called: compiled, contract-checked, linked, and described.
pub struct LoadedPlugin {
    sandbox: Arc<Sandbox>,
    pre: Pre,
    descriptor: Descriptor,
    contract: Version,
    origin: PluginOrigin,
    sha256: String,
    name: Arc<str>,
    /// Calls stopped by a deadline since the plugin was loaded.
    deadlines_passed: AtomicU64,
}

impl LoadedPlugin {
    /// Compile `bytes`, check that they are a plugin of a compatible contract version whose imports
    /// this host provides, and call `describe()`.
    pub fn load(
        sandbox: Arc<Sandbox>,
        bytes: &[u8],
        origin: PluginOrigin,
    ) -> Result<LoadedPlugin, LoadError> {
        let label = origin.to_string();
        let sha256 = hex::encode(Sha256::digest(bytes));
        let component =
            sandbox
                .compile(bytes, &sha256)
                .map_err(|e| LoadError::InvalidComponent {
                    origin: label.clone(),
                    reason: format!("{e:#}"),
                })?;
        let contract = exported_contract_version(&sandbox, &component, &label)?;
        let instance_pre = sandbox.linker().instantiate_pre(&component).map_err(|e| {
            LoadError::ContractMismatch {
                origin: label.clone(),
                reason: format!("it needs an import this host does not provide: {e:#}"),
            }
        })?;
        let exports_mismatch = |e: wasmtime::Error| LoadError::ContractMismatch {
            origin: label.clone(),
            reason: format!("its exports do not match the contract: {e:#}"),
        };
        let pre = match contract.supported().map(|v| v.minor) {
            Some(1) => {
                Pre::V0_1(v0_1::ModalityPluginPre::new(instance_pre).map_err(exports_mismatch)?)
            }
            Some(2) => {
                Pre::V0_2(v0_2::ModalityPluginPre::new(instance_pre).map_err(exports_mismatch)?)
            }
            Some(3) => {
                Pre::V0_3(v0_3::ModalityPluginPre::new(instance_pre).map_err(exports_mismatch)?)
            }
            Some(4) => {
                Pre::V0_4(v0_4::ModalityPluginPre::new(instance_pre).map_err(exports_mismatch)?)
            }
            _ => Pre::Current(ModalityPluginPre::new(instance_pre).map_err(exports_mismatch)?),
        };
        let mut plugin = LoadedPlugin {
            sandbox,
            pre,
            descriptor: Descriptor {
                name: String::new(),
                version: String::new(),
                description: String::new(),
                modalities: Vec::new(),
                mime_types: Vec::new(),
                processor_types: Vec::new(),
            },
            contract,
            sha256,
            name: Arc::from(label.as_str()),
            origin,
            deadlines_passed: AtomicU64::new(0),
        };
        let descriptor = plugin
            .call("describe", |store, p| {
                on_plugin!(p, |e| e.call_describe(store))
            })
            .map_err(|source| LoadError::Describe {
                origin: label.clone(),
                source,
            })?;
        check_descriptor(&descriptor).map_err(|reason| LoadError::ContractMismatch {
            origin: label,
            reason,
        })?;
        plugin.name = Arc::from(descriptor.name.as_str());
        plugin.descriptor = descriptor;
        Ok(plugin)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }

    /// The contract version the plugin was built against.
    pub fn contract_version(&self) -> Version {
        self.contract
    }

    pub fn origin(&self) -> &PluginOrigin {
        &self.origin
    }

    /// Calls stopped by a deadline since the plugin was loaded: a stuck plugin, or a server too
    /// loaded to finish its calls.
    pub fn deadlines_passed(&self) -> u64 {
        self.deadlines_passed.load(Ordering::Relaxed)
    }

    /// Hex sha256 of the component bytes.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// `describe()`, in a fresh sandbox.
    pub fn describe(&self) -> Result<Descriptor, CallError> {
        self.call("describe", |store, p| {
            on_plugin!(p, |e| e.call_describe(store))
        })
    }

    /// `probe(media)`: read the header.
    pub fn probe(&self, media: &Media) -> Result<MediaInfo, CallError> {
        self.call("probe", |store, p| {
            on_plugin!(p, |e| e.call_probe(&mut *store, media))
        })?
        .map_err(CallError::Plugin)
    }

    /// `plan(info, budget, config)`: decide what to produce and its exact token cost.
    pub fn plan(
        &self,
        info: &MediaInfo,
        budget: Budget,
        processor_config: &str,
    ) -> Result<TokenPlan, CallError> {
        let config = processor_config.to_owned();
        self.call("plan", |store, p| {
            on_plugin!(p, |e| e.call_plan(&mut *store, info, budget, &config))
        })?
        .map_err(CallError::Plugin)
    }

    /// `preprocess(media, plan, config)`: produce the tensors, checked against the contract and the
    /// output cap before they are handed on.
    pub fn preprocess(
        &self,
        media: &Media,
        plan: &TokenPlan,
        processor_config: &str,
    ) -> Result<Vec<Tensor>, CallError> {
        let config = processor_config.to_owned();
        let tensors = self
            .call_making("preprocess", Making::Item, plan, |store, p| {
                on_plugin!(p, |e| e.call_preprocess(&mut *store, media, plan, &config))
            })?
            .map_err(CallError::Plugin)?;
        self.checked_output(tensors)
    }

    /// `parts(plan, config)`: how many independent parts the planned item's tensors come in (contract
    /// 0.4; a plugin built against an earlier one makes every item whole: 1).
    pub fn parts(&self, plan: &TokenPlan, processor_config: &str) -> Result<u32, CallError> {
        if !self.makes_parts() {
            return Ok(1);
        }
        let config = processor_config.to_owned();
        let parts = self
            .call("parts", |store, instance| match instance {
                Instance::Current(p) => {
                    p.mmgate_modality_plugin()
                        .call_parts(&mut *store, plan, &config)
                }
                Instance::V0_4(p) => {
                    p.mmgate_modality_plugin()
                        .call_parts(&mut *store, plan, &config)
                }
                Instance::V0_3(_) | Instance::V0_2(_) | Instance::V0_1(_) => Ok(Ok(1)),
            })?
            .map_err(CallError::Plugin)?;
        if parts == 0 || parts > MAX_PARTS {
            return Err(CallError::Contract(format!(
                "parts returned {parts}: an item has 1 to {MAX_PARTS} parts"
            )));
        }
        Ok(parts)
    }

    /// Checks an item's parts, made one call each, against the output cap one `preprocess` call
    /// has: together they are the item, and may be no larger.
    pub fn check_parts_output(&self, parts: &[Vec<Tensor>]) -> Result<(), CallError> {
        self.check_output_size(tensor_bytes(parts.iter().flatten()))
    }

    /// `size` bytes of an item's output against the cap one `preprocess` call has (parts handed
    /// on one by one add up their sizes as they come).
    pub fn check_output_size(&self, size: usize) -> Result<(), CallError> {
        let limit = self.sandbox.limits().max_output_bytes;
        if size > limit {
            return Err(CallError::OutputTooLarge { size, limit });
        }
        Ok(())
    }

    /// Part `index` as [`Self::preprocess_part`] makes it, checked against its entry of
    /// `part-plans`: every placing tensor among the part's, the same in name, type, shape and
    /// values (the host placed the part by them before it was made).
    pub fn preprocess_planned_part(
        &self,
        media: &Media,
        plan: &TokenPlan,
        processor_config: &str,
        index: u32,
        part_plan: &PartPlan,
    ) -> Result<Vec<Tensor>, CallError> {
        let tensors = self.preprocess_part(media, plan, processor_config, index)?;
        for placing in &part_plan.placing {
            let same = |t: &&Tensor| {
                t.name == placing.name
                    && t.dtype == placing.dtype
                    && t.shape == placing.shape
                    && t.data == placing.data
            };
            if !tensors.iter().any(|t| same(&t)) {
                return Err(CallError::Contract(format!(
                    "part {index}'s {} is not the one its part plan gave",
                    placing.name
                )));
            }
        }
        Ok(tensors)
    }

    /// Whether the plugin's contract has `parts` and `preprocess-part` (0.4 and later).
    fn makes_parts(&self) -> bool {
        matches!(self.pre, Pre::Current(_) | Pre::V0_4(_))
    }

    /// `part-plans(plan, config)`: where each of the item's `parts` parts goes, before any is made
    /// (contract 0.5); `None` when the plugin cannot say (built against an earlier contract, or
    /// it answers `unsupported`): its parts are placed once made. Checked: one entry per part,
    /// the tokens adding up to the plan's, every placing tensor well formed.
    pub fn part_plans(
        &self,
        plan: &TokenPlan,
        processor_config: &str,
        parts: u32,
    ) -> Result<Option<Vec<PartPlan>>, CallError> {
        if !matches!(self.pre, Pre::Current(_)) {
            return Ok(None);
        }
        let config = processor_config.to_owned();
        let plans = self.call("part-plans", |store, instance| match instance {
            Instance::Current(p) => {
                p.mmgate_modality_plugin()
                    .call_part_plans(&mut *store, plan, &config)
            }
            // Checked above: an older plugin is never asked.
            _ => Err(wasmtime::format_err!(
                "part-plans called on a plugin of contract {}",
                self.contract
            )),
        })?;
        let plans = match plans {
            Ok(plans) => plans,
            Err(PluginError::Unsupported(_)) => return Ok(None),
            Err(error) => return Err(CallError::Plugin(error)),
        };
        if plans.len() != parts as usize {
            return Err(CallError::Contract(format!(
                "part-plans returned {} entries for {parts} parts",
                plans.len()
            )));
        }
        let tokens = plans
            .iter()
            .try_fold(0u32, |sum, part| sum.checked_add(part.tokens));
        if tokens != Some(plan.tokens) {
            return Err(CallError::Contract(format!(
                "part-plans' tokens add up to {}, not the plan's {}",
                tokens.map_or_else(|| "more than 2^32".into(), |t| t.to_string()),
                plan.tokens
            )));
        }
        plans
            .iter()
            .flat_map(|part| &part.placing)
            .try_for_each(Tensor::validate)?;
        Ok(Some(plans))
    }

    /// `preprocess-part(media, plan, config, index)`: the tensors of one part, checked as
    /// `preprocess`'s. Part 0 of a plugin built against an earlier contract is the whole item.
    pub fn preprocess_part(
        &self,
        media: &Media,
        plan: &TokenPlan,
        processor_config: &str,
        index: u32,
    ) -> Result<Vec<Tensor>, CallError> {
        if !self.makes_parts() {
            return match index {
                0 => self.preprocess(media, plan, processor_config),
                _ => Err(CallError::Contract(format!(
                    "part {index} of a plugin of contract {}, which makes items whole",
                    self.contract
                ))),
            };
        }
        let config = processor_config.to_owned();
        let tensors = self
            .call_making(
                "preprocess-part",
                Making::Part,
                plan,
                |store, instance| match instance {
                    Instance::Current(p) => p.mmgate_modality_plugin().call_preprocess_part(
                        &mut *store,
                        media,
                        plan,
                        &config,
                        index,
                    ),
                    Instance::V0_4(p) => p.mmgate_modality_plugin().call_preprocess_part(
                        &mut *store,
                        media,
                        plan,
                        &config,
                        index,
                    ),
                    // Checked above: an older plugin is never asked.
                    Instance::V0_3(_) | Instance::V0_2(_) | Instance::V0_1(_) => {
                        Err(wasmtime::format_err!(
                            "preprocess-part called on a plugin of contract {}",
                            self.contract
                        ))
                    }
                },
            )?
            .map_err(CallError::Plugin)?;
        self.checked_output(tensors)
    }

    /// Tensors checked against the output cap and the contract's rules.
    fn checked_output(&self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        let limit = self.sandbox.limits().max_output_bytes;
        let size = tensors
            .iter()
            .map(|t| t.data.len())
            .fold(0usize, usize::saturating_add);
        if size > limit {
            return Err(CallError::OutputTooLarge { size, limit });
        }
        tensors.iter().try_for_each(Tensor::validate)?;
        Ok(tensors)
    }

    /// `reduce(media, plan, config)`: the item as planned, as files for a model server that runs its
    /// own processor (contract 0.3; a plugin built against an earlier one cannot, and says so as
    /// `unsupported`). Checked against the output cap like tensors.
    pub fn reduce(
        &self,
        media: &Media,
        plan: &TokenPlan,
        processor_config: &str,
    ) -> Result<ReducedItem, CallError> {
        if matches!(self.pre, Pre::V0_2(_) | Pre::V0_1(_)) {
            return Err(CallError::Plugin(PluginError::Unsupported(format!(
                "plugin {} is built against contract {}, which has no reduce (0.3 added it): \
                 rebuild it with the current SDK to serve this model",
                self.name, self.contract
            ))));
        }
        let config = processor_config.to_owned();
        let reduced = self
            .call_making(
                "reduce",
                Making::Item,
                plan,
                |store, instance| match instance {
                    Instance::Current(p) => {
                        p.mmgate_modality_plugin()
                            .call_reduce(&mut *store, media, plan, &config)
                    }
                    Instance::V0_4(p) => {
                        p.mmgate_modality_plugin()
                            .call_reduce(&mut *store, media, plan, &config)
                    }
                    Instance::V0_3(p) => {
                        p.mmgate_modality_plugin()
                            .call_reduce(&mut *store, media, plan, &config)
                    }
                    // Checked above: an older plugin is never asked.
                    Instance::V0_2(_) | Instance::V0_1(_) => Err(wasmtime::format_err!(
                        "reduce called on a plugin of contract {}",
                        self.contract
                    )),
                },
            )?
            .map_err(CallError::Plugin)?;
        let limit = self.sandbox.limits().max_output_bytes;
        let size = reduced
            .files
            .iter()
            .map(|f| f.data.len())
            .fold(0usize, usize::saturating_add);
        if size > limit {
            return Err(CallError::OutputTooLarge { size, limit });
        }
        if reduced.files.is_empty() || reduced.files.len() != reduced.timestamps.len() {
            return Err(CallError::Contract(format!(
                "reduce returned {} files and {} timestamps: at least one file, one timestamp each",
                reduced.files.len(),
                reduced.timestamps.len()
            )));
        }
        Ok(reduced)
    }

    /// Run `f` against a fresh instance in a fresh store with this sandbox's limits, and turn whatever
    /// went wrong into a typed [`CallError`].
    fn call<R>(
        &self,
        function: &'static str,
        f: impl FnOnce(&mut Store<CallState>, &Instance) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        let limits = self.sandbox.limits();
        let state = CallState::new(self.name.clone(), function, limits, limits.deadline());
        self.run(state, f)
    }

    /// [`Self::call`] for a call that makes `making` of `plan`: its CPU deadline grows with the
    /// plan's tokens (see [`crate::SandboxLimits::deadline_for`]).
    fn call_making<R>(
        &self,
        function: &'static str,
        making: Making,
        plan: &TokenPlan,
        f: impl FnOnce(&mut Store<CallState>, &Instance) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        let limits = self.sandbox.limits();
        let deadline = limits.deadline_for(plan.tokens);
        let mut state = CallState::new(self.name.clone(), function, limits, deadline);
        if making == Making::Part {
            state.decode_videos_on_one_thread();
        }
        self.run(state, f)
    }

    /// Runs `f` in a fresh store holding `state`.
    fn run<R>(
        &self,
        state: CallState,
        f: impl FnOnce(&mut Store<CallState>, &Instance) -> wasmtime::Result<R>,
    ) -> Result<R, CallError> {
        let limits = self.sandbox.limits();
        let mut store = Store::new(self.sandbox.engine(), state);
        store.limiter(|state| state.limiter());
        // The epoch deadline is when to look at the call's clocks again: the plugin's own time
        // left can only pass when that much wall time has.
        store.set_epoch_deadline(Sandbox::ticks(
            limits.deadline().min(limits.wall_deadline()),
        ));
        store.epoch_deadline_callback(|mut store| match store.data_mut().next_check() {
            Ok(ticks) => Ok(UpdateDeadline::Continue(ticks)),
            Err(_) => Err(Trap::Interrupt.into()),
        });
        // wasmtime caps what one call may copy out of the guest (128 MiB by default, which a large
        // image's f32 patches exceed); our own cap is max_output_bytes, checked precisely after the
        // copy, so wasmtime's is set just above it and only stops a guest that goes far past it.
        store.set_hostcall_fuel(limits.max_output_bytes.saturating_add(HOSTCALL_FUEL_SLACK));
        let instance = match &self.pre {
            Pre::Current(pre) => pre.instantiate(&mut store).map(Instance::Current),
            Pre::V0_4(pre) => pre.instantiate(&mut store).map(Instance::V0_4),
            Pre::V0_3(pre) => pre.instantiate(&mut store).map(Instance::V0_3),
            Pre::V0_2(pre) => pre.instantiate(&mut store).map(Instance::V0_2),
            Pre::V0_1(pre) => pre.instantiate(&mut store).map(Instance::V0_1),
        };
        let result = instance.and_then(|instance| f(&mut store, &instance));
        // A deadline that passed fails the call even when the plugin made something of the host
        // capability's error that stopped at it (the plugin may only see "limit exceeded").
        if let Some(passed) = store.data().deadline_passed() {
            self.deadlines_passed.fetch_add(1, Ordering::Relaxed);
            return Err(CallError::Deadline(passed.clone()));
        }
        result.map_err(|error| classify(error, store.data(), &self.sandbox))
    }
}

/// What a plugin call makes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Making {
    /// A whole item, or whatever else a call returns.
    Item,
    /// One part of an item: the gateway makes an item in parts only while two plugin workers or
    /// more are idle, so its parts run beside each other, and a part's video is decoded on one
    /// thread (a second decoder thread only adds FFmpeg's handing frames between its threads).
    Part,
}

/// Bytes of tensor data, saturating.
pub fn tensor_bytes<'t>(tensors: impl IntoIterator<Item = &'t Tensor>) -> usize {
    tensors
        .into_iter()
        .map(|t| t.data.len())
        .fold(0usize, usize::saturating_add)
}

/// Room above `max_output_bytes` in wasmtime's copy budget for everything that is not tensor data
/// (names, shapes, plan reasons).
const HOSTCALL_FUEL_SLACK: usize = 16 << 20;

fn classify(error: wasmtime::Error, state: &CallState, sandbox: &Sandbox) -> CallError {
    if state.memory_limit_hit() {
        return CallError::Memory {
            limit: sandbox.limits().memory_bytes,
        };
    }
    // wasmtime reports its copy budget running out only in the message.
    if format!("{error:#}").contains("fuel allocated for hostcalls has been exhausted") {
        let limit = sandbox.limits().max_output_bytes;
        return CallError::OutputTooLarge {
            size: limit.saturating_add(HOSTCALL_FUEL_SLACK),
            limit,
        };
    }
    match error.downcast_ref::<Trap>() {
        // Interrupted but no deadline recorded: the engine's epoch went on without a check.
        Some(Trap::Interrupt) => CallError::Trap("interrupted".into()),
        Some(Trap::StackOverflow) => CallError::Trap("wasm stack overflow".into()),
        Some(trap) => CallError::Trap(trap.to_string()),
        None => CallError::Host(format!("{error:#}")),
    }
}

/// Find the `mmgate:modality/plugin@X.Y.Z` export and check its version against this host's.
fn exported_contract_version(
    sandbox: &Sandbox,
    component: &Component,
    label: &str,
) -> Result<Version, LoadError> {
    let ty = component.component_type();
    let prefix = format!("{PLUGIN_INTERFACE}@");
    let exported: Vec<&str> = ty.exports(sandbox.engine()).map(|(name, _)| name).collect();
    let Some(version_text) = exported.iter().find_map(|name| name.strip_prefix(&prefix)) else {
        return Err(LoadError::ContractMismatch {
            origin: label.to_owned(),
            reason: format!(
                "it does not export {PLUGIN_INTERFACE} (exports: {}); is it built against the \
                 mmgate plugin SDK?",
                if exported.is_empty() {
                    "none".to_owned()
                } else {
                    exported.join(", ")
                }
            ),
        });
    };
    let version = Version::parse(version_text).ok_or_else(|| LoadError::ContractMismatch {
        origin: label.to_owned(),
        reason: format!("unreadable contract version {version_text:?}"),
    })?;
    if version.supported().is_none() {
        let compatible: Vec<String> = SUPPORTED_VERSIONS
            .iter()
            .map(|v| format!("{}.{}.x up to {v}", v.major, v.minor))
            .collect();
        return Err(LoadError::ContractMismatch {
            origin: label.to_owned(),
            reason: format!(
                "built for contract {version}, but this host implements {CONTRACT_VERSION} \
                 (compatible: {})",
                compatible.join(", ")
            ),
        });
    }
    Ok(version)
}

/// What the host needs of a descriptor to route requests to the plugin.
fn check_descriptor(d: &Descriptor) -> Result<(), String> {
    let valid_name = !d.name.is_empty()
        && d.name.len() <= 64
        && d.name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !valid_name {
        return Err(format!(
            "describe() returned the name {:?}: use 1-64 of a-z, 0-9, '-', '_'",
            d.name
        ));
    }
    if Version::parse(&d.version).is_none() {
        return Err(format!(
            "describe() returned the version {:?}: use major.minor.patch",
            d.version
        ));
    }
    if d.modalities.is_empty() || d.modalities.iter().any(|m| m.is_empty()) {
        return Err("describe() must name at least one modality".into());
    }
    Ok(())
}
