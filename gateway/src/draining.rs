//! Whether this replica is draining: set when a SIGTERM starts its shutdown, read by `/ready` so
//! that a load balancer stops sending it traffic before its listener closes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Shared by the shutdown watch that sets it and the routes that read it.
#[derive(Clone, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// From now on, the replica is draining.
    pub fn begin(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
