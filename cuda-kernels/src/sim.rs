//! Launching kernels on the CPU simulator (`sim/sim.h`): the same sources, the same grid, block and
//! argument list as a launch through the driver.
//!
//! Arguments are passed as the driver takes them, an array of pointers to each argument's value, so
//! the simulator is exactly as (un)typed as `cuLaunchKernel`: the caller must pass what the kernel
//! declares. [`Arg`] keeps that to the few kinds the kernels use.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_void};

unsafe extern "C" {
    fn mmgate_sim_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: u32,
        args: *mut *mut c_void,
        error: *mut c_char,
        error_len: usize,
    ) -> i32;
    fn mmgate_sim_has_kernel(name: *const c_char) -> i32;
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("kernel name {0:?} has a NUL byte")]
    Name(String),
    #[error("simulated launch of {kernel} refused: {reason}")]
    Refused { kernel: String, reason: String },
}

/// One kernel argument. Pointers are host addresses: in the simulator, "device memory" is host
/// memory the caller owns and keeps alive (and does not otherwise touch) for the launch.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(*mut c_void),
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
}

/// Whether the simulator was built with `kernel`.
pub fn has_kernel(kernel: &str) -> bool {
    let Ok(name) = CString::new(kernel) else {
        return false;
    };
    // SAFETY: `name` is a valid NUL-terminated string for the call's duration.
    unsafe { mmgate_sim_has_kernel(name.as_ptr()) == 1 }
}

/// Runs `kernel` over `grid` × `block` with `args`.
///
/// # Safety
/// The arguments must match the kernel's parameter list in number, order and type, and every
/// pointer must be valid for all the reads and writes the kernel makes with these arguments
/// (as for a driver launch).
pub unsafe fn launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &[Arg],
) -> Result<(), SimError> {
    let name = CString::new(kernel).map_err(|_| SimError::Name(kernel.to_owned()))?;
    // The values the pointer array points at, kept alive across the call.
    let mut values: Vec<Arg> = args.to_vec();
    let mut pointers: Vec<*mut c_void> = values
        .iter_mut()
        .map(|a| match a {
            Arg::Ptr(p) => p as *mut *mut c_void as *mut c_void,
            Arg::U32(v) => v as *mut u32 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::U64(v) => v as *mut u64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
        })
        .collect();
    let mut error = [0 as c_char; 256];
    // SAFETY: the name, dimension arrays, pointer array and error buffer are valid for the call;
    // that the arguments fit the kernel is the caller's promise.
    let status = unsafe {
        mmgate_sim_launch(
            name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            0,
            pointers.as_mut_ptr(),
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if status == 0 {
        return Ok(());
    }
    // SAFETY: the simulator writes a NUL-terminated message into `error` (snprintf).
    let reason = unsafe { CStr::from_ptr(error.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Err(SimError::Refused {
        kernel: kernel.to_owned(),
        reason,
    })
}
