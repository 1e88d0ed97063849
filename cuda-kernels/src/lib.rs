//! The CUDA C kernels of mmgate's CUDA backend, as source text.
//!
//! The backend compiles them at run time with NVRTC for the GPU it finds (so nothing CUDA is needed
//! to build mmgate, and one binary serves every architecture); the tests compile them with NVRTC
//! for sm_80 and sm_90 without a GPU, and run them on the CPU through [`sim`], a simulator of
//! CUDA's execution model that compiles the same sources as C++.
//!
//! Each `kernels/<module>.cu` is one NVRTC program; `kernels/common.cuh` (warp and block
//! reductions, the activations) goes in front of each. The kernel list is read from the sources at
//! build time, so it cannot drift from them.

#[cfg(feature = "sim")]
pub mod sim;

/// One NVRTC program: a `.cu` file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

include!(concat!(env!("OUT_DIR"), "/modules.rs"));

/// The helpers every module is compiled with.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

impl Module {
    /// The full text NVRTC compiles: the common helpers, then the module.
    pub fn program(&self) -> String {
        format!("{COMMON}\n{}", self.source)
    }
}

/// The module that defines `kernel`.
pub fn module_of(kernel: &str) -> Option<&'static Module> {
    MODULES.iter().find(|m| m.kernels.contains(&kernel))
}

/// Every kernel name, in module order.
pub fn kernels() -> impl Iterator<Item = &'static str> {
    MODULES.iter().flat_map(|m| m.kernels.iter().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_defines_kernels_with_distinct_names() {
        assert!(MODULES.len() >= 6);
        let mut names: Vec<&str> = kernels().collect();
        let count = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), count, "a kernel name appears twice");
        for m in MODULES {
            assert!(!m.kernels.is_empty(), "{} defines no kernel", m.name);
            assert!(m.program().starts_with(COMMON));
        }
        assert_eq!(module_of("attention").map(|m| m.name), Some("attention"));
    }
}
