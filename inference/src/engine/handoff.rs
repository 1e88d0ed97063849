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
//!
//! The rendezvous is generic over what it hands, so that it knows nothing of the inputs themselves:
//! the engine's handoffs carry an [`EncodeInput`](super::EncodeInput) (see
//! [`engine::Handoff`](super::Handoff)).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// An input or why it could not be made.
pub type Handed<T> = std::result::Result<T, String>;

type Action<T> = Box<dyn FnOnce(Handed<T>) + Send>;

enum State<T> {
    Waiting,
    Delivered(Handed<T>),
    Attached(Action<T>),
    Done,
}

/// One piece's meeting point (see the module docs).
pub struct Handoff<T> {
    id: u64,
    state: Mutex<State<T>>,
}

impl<T> std::fmt::Debug for Handoff<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff").field("id", &self.id).finish()
    }
}

/// The maker's side of a [`Handoff`]: delivers once; dropped undelivered, it delivers a failure.
#[derive(Debug)]
pub struct Delivery<T>(Option<Arc<Handoff<T>>>);

impl<T> Handoff<T> {
    /// A new handoff (for the engine's item) and its delivery (for whoever makes the input).
    pub fn new() -> (Arc<Handoff<T>>, Delivery<T>) {
        // One counter for every `T` (a static in a generic fn is not per instance): ids stay
        // unique in the process.
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

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // The state stays consistent whatever a panicking holder did: each step replaces it whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What to do with the input: now if it was delivered, else when it is. Only the first
    /// attachment counts.
    pub(crate) fn attach(&self, action: impl FnOnce(Handed<T>) + Send + 'static) {
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

    fn put(&self, input: Handed<T>) {
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

impl<T> Delivery<T> {
    /// Hands the input (or why there is none) to the engine.
    pub fn deliver(mut self, input: Handed<T>) {
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

impl<T> Drop for Delivery<T> {
    fn drop(&mut self) {
        if let Some(handoff) = self.0.take() {
            handoff.put(Err("the piece's maker stopped before making it".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the tests hand over.
    type Input = Vec<f32>;

    fn input() -> Input {
        vec![1.0]
    }

    /// What an action saw: each input's length, or the failure.
    type Seen = Arc<Mutex<Vec<Result<usize, String>>>>;

    fn recorder() -> (Seen, impl FnOnce(Handed<Input>) + Send + 'static) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let action = move |input: Handed<Input>| {
            log.lock()
                .unwrap()
                .push(input.map(|i| i.len()).map_err(|e| e.to_string()));
        };
        (seen, action)
    }

    #[test]
    fn the_input_reaches_the_action_in_either_order() {
        let (handoff, delivery) = Handoff::<Input>::new();
        let (seen, action) = recorder();
        handoff.attach(action);
        assert!(seen.lock().unwrap().is_empty());
        delivery.deliver(Ok(input()));
        assert_eq!(*seen.lock().unwrap(), vec![Ok(1)]);

        let (handoff, delivery) = Handoff::<Input>::new();
        let (seen, action) = recorder();
        delivery.deliver(Ok(input()));
        handoff.attach(action);
        assert_eq!(*seen.lock().unwrap(), vec![Ok(1)]);
    }

    #[test]
    fn a_maker_gone_without_delivering_delivers_a_failure_once() {
        let (handoff, delivery) = Handoff::<Input>::new();
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
        let (handoff, delivery) = Handoff::<Input>::new();
        assert!(delivery.awaited());
        drop(handoff);
        assert!(!delivery.awaited());
    }

    #[test]
    fn handoffs_are_named_apart() {
        let (a, _) = Handoff::<Input>::new();
        let (b, _) = Handoff::<Input>::new();
        assert_ne!(a.id(), b.id());
    }
}
