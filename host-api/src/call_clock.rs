//! The clocks one plugin call is held to. A deadline is there to stop a plugin that is stuck or
//! hostile, not to refuse media that a busy machine is slow to get through: what the media may
//! cost is bounded by the limits, checked on what the client sent. So the call's budget is the
//! **plugin's own CPU time** (its thread's CPU time less what host capabilities, video and image
//! decoding, spent on its behalf), which neither other requests sharing the cores nor host work
//! bounded by the limits can use up; a wall-clock budget, far larger, backs it for a call that
//! makes no progress at all. Where the platform has no per-thread CPU clock, the plugin's own
//! time is wall-clock time less the host work's.

use std::time::{Duration, Instant};

use crate::error::{DeadlineClock, DeadlinePassed};

/// The calling thread's CPU time, where the platform measures it.
fn thread_cpu_time() -> Option<Duration> {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        let nanos = u32::try_from(t.tv_nsec).ok()?;
        Some(Duration::new(u64::try_from(t.tv_sec).ok()?, nanos))
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    {
        None
    }
}

/// Where a stretch of host work began, on the clock the call's own time is read from.
#[derive(Clone, Copy)]
struct HostWorkMark(Duration);

/// One call's clocks and budgets; the call runs on one thread from start to end.
pub(crate) struct CallClock {
    plugin: String,
    call: &'static str,
    started: Instant,
    /// The thread's CPU time at the start; `None` where there is no per-thread CPU clock.
    started_cpu: Option<Duration>,
    /// Time host capabilities spent for the plugin, on the same clock.
    host: Duration,
    cpu_limit: Duration,
    wall_limit: Duration,
    passed: Option<DeadlinePassed>,
}

impl CallClock {
    pub(crate) fn start(
        plugin: &str,
        call: &'static str,
        cpu_limit: Duration,
        wall_limit: Duration,
    ) -> CallClock {
        CallClock {
            plugin: plugin.to_owned(),
            call,
            started: Instant::now(),
            started_cpu: thread_cpu_time(),
            host: Duration::ZERO,
            cpu_limit,
            wall_limit,
            passed: None,
        }
    }

    /// The thread's time since the call started, host work included.
    fn elapsed(&self) -> Duration {
        match (self.started_cpu, thread_cpu_time()) {
            (Some(start), Some(now)) => now.saturating_sub(start),
            _ => self.started.elapsed(),
        }
    }

    /// The plugin's own time so far.
    pub(crate) fn own(&self) -> Duration {
        self.elapsed().saturating_sub(self.host)
    }

    /// Runs `work` a host capability does for the plugin, charged to the host rather than to the
    /// plugin's own time.
    pub(crate) fn host_work<R>(&mut self, work: impl FnOnce() -> R) -> R {
        let mark = self.host_work_starts();
        let result = work();
        self.host_work_ends(mark);
        result
    }

    /// Marks the start of work a host capability does for the plugin.
    fn host_work_starts(&self) -> HostWorkMark {
        HostWorkMark(self.elapsed())
    }

    /// Charges the host work since `mark` to the host, not to the plugin.
    fn host_work_ends(&mut self, mark: HostWorkMark) {
        self.host += self.elapsed().saturating_sub(mark.0);
    }

    /// When the wall-clock backstop passes: host work on the plugin's behalf stops there too.
    pub(crate) fn wall_deadline(&self) -> Instant {
        self.started + self.wall_limit
    }

    /// Time left before either budget runs out.
    pub(crate) fn remaining(&self) -> Duration {
        let wall = self
            .wall_deadline()
            .saturating_duration_since(Instant::now());
        self.cpu_limit.saturating_sub(self.own()).min(wall)
    }

    /// Checked whenever the plugin's epoch deadline comes: the plugin's own time left, or why the
    /// call must stop (recorded, for the call's error).
    pub(crate) fn check(&mut self) -> Result<Duration, DeadlinePassed> {
        let wall = self.started.elapsed();
        if wall >= self.wall_limit {
            return Err(self.pass(DeadlineClock::Wall, wall));
        }
        let own = self.own();
        if own >= self.cpu_limit {
            return Err(self.pass(DeadlineClock::PluginCpu, own));
        }
        Ok((self.cpu_limit - own).min(self.wall_limit - wall))
    }

    /// A host capability gave up at the wall-clock backstop: the call fails for that, whatever the
    /// plugin makes of the capability's error.
    pub(crate) fn host_ran_out(&mut self) {
        let wall = self.started.elapsed();
        self.pass(DeadlineClock::Wall, wall);
    }

    fn pass(&mut self, clock: DeadlineClock, spent: Duration) -> DeadlinePassed {
        let limit = match clock {
            DeadlineClock::PluginCpu => self.cpu_limit,
            DeadlineClock::Wall => self.wall_limit,
        };
        let passed = DeadlinePassed {
            plugin: self.plugin.clone(),
            call: self.call,
            clock,
            limit,
            spent,
        };
        self.passed.get_or_insert(passed).clone()
    }

    /// Why the call was stopped, if a deadline passed.
    pub(crate) fn passed(&self) -> Option<&DeadlinePassed> {
        self.passed.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burns `d` of this thread's CPU time (of wall time where there is no CPU clock).
    fn spin(d: Duration) {
        let (cpu, wall) = (thread_cpu_time(), Instant::now());
        let mut x = 0u64;
        loop {
            let spent = match (cpu, thread_cpu_time()) {
                (Some(a), Some(b)) => b.saturating_sub(a),
                _ => wall.elapsed(),
            };
            if spent >= d {
                break;
            }
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn host_work_is_not_the_plugins_time() {
        let mut clock = CallClock::start("p", "preprocess", HOUR, HOUR);
        let mark = clock.host_work_starts();
        spin(Duration::from_millis(200));
        clock.host_work_ends(mark);
        assert!(
            clock.own() < Duration::from_millis(100),
            "{:?}",
            clock.own()
        );
        spin(Duration::from_millis(200));
        assert!(
            clock.own() >= Duration::from_millis(200),
            "{:?}",
            clock.own()
        );
    }

    #[test]
    fn sleeping_is_not_the_plugins_cpu_time() {
        if thread_cpu_time().is_none() {
            return;
        }
        let mut clock = CallClock::start("p", "probe", Duration::from_millis(30), HOUR);
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            clock.check().is_ok(),
            "sleeping used no CPU: {:?}",
            clock.own()
        );
    }

    #[test]
    fn each_budget_stops_the_call_and_says_which() {
        let mut clock = CallClock::start("p", "plan", Duration::from_millis(20), HOUR);
        spin(Duration::from_millis(30));
        let passed = clock.check().unwrap_err();
        assert_eq!(passed.clock, DeadlineClock::PluginCpu);
        assert!(passed.spent >= Duration::from_millis(20));
        assert_eq!(clock.passed(), Some(&passed));

        let mut clock = CallClock::start("p", "probe", HOUR, Duration::ZERO);
        let passed = clock.check().unwrap_err();
        assert_eq!((passed.clock, passed.call), (DeadlineClock::Wall, "probe"));
        assert!(
            passed.to_string().contains("plugin p was stopped in probe"),
            "{passed}"
        );
    }
}
