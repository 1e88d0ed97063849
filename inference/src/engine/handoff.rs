//! Inputs handed over after their request was submitted: the pieces of an item that are still
//! being made when the engine admits the request (a video's later frame groups while its first
//! encodes). The request is placed from what is known beforehand (each piece's tokens and grid);
//! each piece's input arrives through its [`Handoff`] and goes to the encoders at once.
//!
//! A handoff is a rendezvous of two one-shot events in either order: the engine attaching what to
//! do with the input (when it admits the request, which may be before or after the input is made)
//! and the maker delivering it. Whichever comes second runs the engine's action. A maker that goes
//! away without delivering delivers a failure, so the request never waits for a piece that will
//! not come.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::encoder::EncodeInput;

/// An input or why it could not be made.
pub type Handed = std::result::Result<EncodeInput, String>;

type Action = Box<dyn FnOnce(Handed) + Send>;

enum State {
    Waiting,
    Delivered(Handed),
    Attached(Action),
    Done,
}

/// One piece's meeting point (see the module docs).
pub struct Handoff {
    id: u64,
    state: Mutex<State>,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff").field("id", &self.id).finish()
    }
}

/// The maker's side of a [`Handoff`]: delivers once; dropped undelivered, it delivers a failure.
#[derive(Debug)]
pub struct Delivery(Option<Arc<Handoff>>);

impl Handoff {
    /// A new handoff (for the engine's item) and its delivery (for whoever makes the input).
    pub fn new() -> (Arc<Handoff>, Delivery) {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let handoff = Arc::new(Handoff {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State::Waiting),
        });
        (handoff.clone(), Delivery(Some(handoff)))
    }

    /// Unique in the process: what names the input in the feature store before it exists.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent whatever a panicking holder did: each step replaces it whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What to do with the input: now if it was delivered, else when it is. Only the first
    /// attachment counts.
    pub(crate) fn attach(&self, action: impl FnOnce(Handed) + Send + 'static) {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, State::Done) {
            State::Waiting => *state = State::Attached(Box::new(action)),
            State::Delivered(input) => {
                drop(state);
                action(input);
            }
            other @ (State::Attached(_) | State::Done) => *state = other,
        }
    }

    fn put(&self, input: Handed) {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, State::Done) {
            State::Waiting => *state = State::Delivered(input),
            State::Attached(action) => {
                drop(state);
                action(input);
            }
            other @ (State::Delivered(_) | State::Done) => *state = other,
        }
    }
}

impl Delivery {
    /// Hands the input (or why there is none) to the engine.
    pub fn deliver(mut self, input: Handed) {
        if let Some(handoff) = self.0.take() {
            handoff.put(input);
        }
    }

    /// Whether a request still waits for this input: false once the engine let go of its item
    /// (the request finished, failed or was cancelled), when dropping it undelivered is expected.
    pub fn awaited(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|handoff| Arc::strong_count(handoff) > 1)
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Some(handoff) = self.0.take() {
            handoff.put(Err("the piece's maker stopped before making it".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn audio() -> EncodeInput {
        EncodeInput::Audio {
            features: vec![1.0],
            valid_frames: vec![1],
        }
    }

    /// What an action saw: each input's bytes, or the failure.
    type Seen = Arc<Mutex<Vec<Result<usize, String>>>>;

    fn recorder() -> (Seen, impl FnOnce(Handed) + Send + 'static) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let action = move |input: Handed| {
            log.lock()
                .unwrap()
                .push(input.map(|i| i.bytes()).map_err(|e| e.to_string()));
        };
        (seen, action)
    }

    #[test]
    fn the_input_reaches_the_action_in_either_order() {
        let (handoff, delivery) = Handoff::new();
        let (seen, action) = recorder();
        handoff.attach(action);
        assert!(seen.lock().unwrap().is_empty());
        delivery.deliver(Ok(audio()));
        assert_eq!(*seen.lock().unwrap(), vec![Ok(4)]);

        let (handoff, delivery) = Handoff::new();
        let (seen, action) = recorder();
        delivery.deliver(Ok(audio()));
        handoff.attach(action);
        assert_eq!(*seen.lock().unwrap(), vec![Ok(4)]);
    }

    #[test]
    fn a_maker_gone_without_delivering_delivers_a_failure_once() {
        let (handoff, delivery) = Handoff::new();
        let (seen, action) = recorder();
        handoff.attach(action);
        drop(delivery);
        let (_, second) = recorder();
        handoff.attach(second);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert!(seen[0].as_ref().is_err_and(|e| e.contains("stopped")));
    }

    #[test]
    fn a_delivery_is_awaited_while_its_handoff_is_held() {
        let (handoff, delivery) = Handoff::new();
        assert!(delivery.awaited());
        drop(handoff);
        assert!(!delivery.awaited());
    }

    #[test]
    fn handoffs_are_named_apart() {
        let (a, _) = Handoff::new();
        let (b, _) = Handoff::new();
        assert_ne!(a.id(), b.id());
    }
}
