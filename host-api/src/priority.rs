//! The CPU priority of the threads that run plugin calls.
//!
//! Plugin calls are the first stage of a media request (decode, resize, log-mel); the encoders and
//! the LLM come after them. Where they share the cores (a CPU deployment), a plugin worker running
//! at the same priority as an encoder or the LLM takes its share of a core from work that is
//! nearer a first token: a long video's first pieces wait to be encoded and prefilled while its
//! later frames are decoded. At a lower priority (a higher `nice` value) the workers still take
//! every core nothing else wants, so a plugin call alone runs as fast as before.

/// Lowers the calling thread's priority to `nice` (0–19; 0 leaves it as it is). Linux keeps a
/// nice value per thread; elsewhere `setpriority` would change the whole process, so this does
/// nothing there. A failure (a sandbox that forbids the call) costs only the priority: logged.
pub fn lower_this_thread(nice: u8) {
    if nice == 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `setpriority` reads its three integer arguments only; `who = 0` with
        // `PRIO_PROCESS` is the calling thread on Linux.
        #[allow(unsafe_code)]
        let result = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, libc::c_int::from(nice)) };
        if result != 0 {
            tracing::warn!(
                "could not lower a plugin worker's priority to nice {nice}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn this_thread_nice() -> i32 {
        // SAFETY: as above; `getpriority` returns the nice value (errno is not needed: a valid
        // `who` cannot fail).
        #[allow(unsafe_code)]
        unsafe {
            libc::getpriority(libc::PRIO_PROCESS, 0)
        }
    }

    #[test]
    fn lowers_only_the_calling_thread() {
        let before = this_thread_nice();
        let lowered = std::thread::spawn(|| {
            lower_this_thread(7);
            this_thread_nice()
        })
        .join()
        .unwrap();
        assert_eq!(lowered, (before + 7).min(19));
        assert_eq!(
            this_thread_nice(),
            before,
            "the spawning thread keeps its priority"
        );
        let unchanged = std::thread::spawn(|| {
            lower_this_thread(0);
            this_thread_nice()
        })
        .join()
        .unwrap();
        assert_eq!(unchanged, before);
    }
}
