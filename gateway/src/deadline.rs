//! Time limits on a connection's reads and writes that cost a timer only when something waits.
//!
//! [`tokio::time::timeout`] makes a timer for every call, and a pending one is put into the timer
//! wheel and taken out again, under the time driver's lock: two of those per relayed request
//! (waiting for the client's next request, and for the upstream's answer) cost the proxy
//! throughput (measured by `bench/proxy.py`). A [`Deadline`] is made once per connection and
//! re-armed for each wait; a later deadline than the one in the wheel is a store to the timer (the
//! wheel moves it when the old one comes), so a kept-alive connection's waits go without the lock.
//! A future that is ready at its first poll gets no timer at all.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// One timer, re-armed for each wait of the reads or writes it limits, one at a time.
#[derive(Default)]
pub struct Deadline {
    /// Made at the first wait.
    timer: Option<Pin<Box<Sleep>>>,
}

/// What [`Deadline::within`] gives when its wait ran out.
#[derive(Debug)]
pub struct TimedOut;

impl Deadline {
    /// `future`'s output if it comes within `wait` (as [`tokio::time::timeout`]); the timer is
    /// armed only once `future` has had to wait.
    pub async fn within<F: Future>(
        &mut self,
        wait: Duration,
        future: F,
    ) -> Result<F::Output, TimedOut> {
        let mut future = std::pin::pin!(future);
        let mut armed = false;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(Ok(output));
            }
            let timer = match &mut self.timer {
                Some(timer) if armed => timer,
                Some(timer) => {
                    timer.as_mut().reset(Instant::now() + wait);
                    armed = true;
                    timer
                }
                None => {
                    armed = true;
                    self.timer.insert(Box::pin(tokio::time::sleep(wait)))
                }
            };
            timer.as_mut().poll(cx).map(|()| Err(TimedOut))
        })
        .await
    }
}

/// [`Deadline::within`] on a timer of its own, for waits that are not a connection's usual ones.
pub async fn within<F: Future>(wait: Duration, future: F) -> Result<F::Output, TimedOut> {
    Deadline::default().within(wait, future).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is ready at once or comes in time is given; what never comes is given up on; and a
    /// re-armed timer counts from its new wait, not from an earlier one that ran out.
    #[tokio::test]
    async fn a_deadline_gives_what_comes_in_time_and_gives_up_on_what_never_does() {
        let minute = Duration::from_secs(60);
        let short = Duration::from_millis(5);
        let mut deadline = Deadline::default();
        assert!(matches!(deadline.within(minute, async { 7 }).await, Ok(7)));
        let later = async {
            tokio::task::yield_now().await;
            8
        };
        assert!(matches!(deadline.within(minute, later).await, Ok(8)));
        let never = std::future::pending::<()>();
        assert!(matches!(deadline.within(short, never).await, Err(TimedOut)));
        // Run out once: re-armed for a minute, a future that comes after a yield is still given.
        let later = async {
            tokio::task::yield_now().await;
            9
        };
        assert!(matches!(deadline.within(minute, later).await, Ok(9)));
        let never = std::future::pending::<()>();
        assert!(matches!(deadline.within(short, never).await, Err(TimedOut)));
        assert!(matches!(
            within(short, std::future::pending::<()>()).await,
            Err(TimedOut)
        ));
    }
}
