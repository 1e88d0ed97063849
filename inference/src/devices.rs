//! Naming and opening the devices a model's parts run on: `cpu` (a thread pool of its own) or
//! `cuda:N` (GPU N through the CUDA backend). A model's LLM and each of its encoder devices are
//! opened separately, so encoders and the LLM can sit on different GPUs, or some on the CPU.

use std::fmt;
use std::str::FromStr;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, DriverDevice};
use crate::error::{Error, Result};

/// The GPU backend as the product runs it.
pub type CudaGpu = CudaBackend<DriverDevice>;

/// A device as configured (`"cpu"`, `"cuda:1"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum DeviceName {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceName {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "cpu" {
            return Ok(Self::Cpu);
        }
        s.strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Self::Cuda)
            .ok_or_else(|| format!("device {s:?}: expected \"cpu\" or \"cuda:N\""))
    }
}

impl TryFrom<String> for DeviceName {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Where one model part runs: a CPU pool of `threads`, or a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu { threads: usize },
    Cuda { ordinal: usize },
}

/// An opened device.
#[derive(Clone)]
pub enum OpenDevice {
    Cpu(CpuBackend),
    Cuda(CudaGpu),
}

impl OpenDevice {
    /// Opens `placement` under `label` (thread names, logs). A `cuda:N` placement on a machine
    /// without the driver, or without GPU N, is an error naming what is missing.
    pub fn open(placement: Placement, label: &str) -> Result<Self> {
        Ok(match placement {
            Placement::Cpu { threads } => Self::Cpu(CpuBackend::new(label, threads)?),
            Placement::Cuda { ordinal } => {
                Self::Cuda(CudaBackend::new(DriverDevice::open(label, ordinal)?))
            }
        })
    }

    /// This device, when `on` and a CPU one, with its bf16-weight linears as bf16 GEMMs and its
    /// attention in bf16 where the CPU has AVX-512 BF16 ([`CpuBackend::with_bf16_inputs`]); a
    /// GPU's linears are bf16 GEMMs already.
    pub fn with_bf16_inputs(self, on: bool) -> Self {
        match self {
            Self::Cpu(cpu) if on => Self::Cpu(cpu.with_bf16_inputs()),
            other => other,
        }
    }
}

impl Placement {
    /// `name` with a thread count for CPU pools; GPUs take none.
    pub fn new(name: DeviceName, threads: Option<usize>) -> Result<Self> {
        match (name, threads) {
            (DeviceName::Cpu, Some(threads)) => Ok(Self::Cpu { threads }),
            (DeviceName::Cpu, None) => {
                Err(Error::Input("a cpu device needs a thread count".into()))
            }
            (DeviceName::Cuda(ordinal), None) => Ok(Self::Cuda { ordinal }),
            (DeviceName::Cuda(n), Some(_)) => Err(Error::Input(format!(
                "cuda:{n}: threads apply to cpu devices only"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_print() {
        assert_eq!("cpu".parse(), Ok(DeviceName::Cpu));
        assert_eq!("cuda:3".parse(), Ok(DeviceName::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA:0", "cuda:0 "] {
            assert!(bad.parse::<DeviceName>().is_err(), "{bad}");
        }
        assert_eq!(DeviceName::Cuda(1).to_string(), "cuda:1");
        assert!(Placement::new(DeviceName::Cuda(0), Some(4)).is_err());
        assert_eq!(
            Placement::new(DeviceName::Cpu, Some(4)).ok(),
            Some(Placement::Cpu { threads: 4 })
        );
    }

    /// This machine has no NVIDIA driver (CI's never does): opening a GPU is an error that says
    /// which library is missing, never a panic.
    #[test]
    fn a_gpu_without_a_driver_is_a_clear_error() {
        match OpenDevice::open(Placement::Cuda { ordinal: 1 }, "enc0") {
            Ok(_) => eprintln!("this machine has a CUDA driver and GPU 1: nothing to check"),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("cuda:1"), "{text}");
                assert!(
                    text.contains("cannot be loaded") || text.contains("cuda:1:"),
                    "{text}"
                );
            }
        }
    }
}
