//! Per-API-key limits: requests per minute (GCRA: a minute's worth may come at once, then the
//! allowance refills evenly), tokens per minute (the same allowance in tokens, charged when an
//! answer ends with what it used: see [`tally`]) and requests in flight. In this process, or in the
//! shared store so that they hold in sum across replicas. Each [`Caller`] has its own allowance; a gateway without
//! API keys has one caller, `public`, so the limits are then the gateway's as a whole.
//!
//! If the shared store is unreachable, requests go through unlimited (and a warning is logged):
//! an outage of the store must not become an outage of the gateway.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http::StatusCode;
use redis::Script;
use serde::Deserialize;

use crate::error::ApiError;
use crate::store::{Caller, Redis};

mod tally;

pub use tally::TokenTally;

/// The window of both per-minute limits.
const MINUTE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KeyLimitsConfig {
    /// Requests one API key may make per minute (absent: no limit).
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt and completion) one API key may use per minute (absent: no limit). A
    /// request is let in while the key has tokens left and charged what it used when it ends.
    pub tokens_per_minute: Option<u64>,
    /// Requests of one API key in flight at once (absent: no limit).
    pub concurrent_requests: Option<u32>,
    /// How long a replica's claim on a concurrent slot lasts in the shared store if the replica dies
    /// before giving it back (a live replica gives it back when its answer ends).
    pub concurrent_lease_seconds: u64,
}

impl Default for KeyLimitsConfig {
    fn default() -> Self {
        KeyLimitsConfig {
            requests_per_minute: None,
            tokens_per_minute: None,
            concurrent_requests: None,
            // Past the default upstream timeout (10 minutes), so a live request keeps its slot.
            concurrent_lease_seconds: 900,
        }
    }
}

impl KeyLimitsConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.requests_per_minute == Some(0)
            || self.tokens_per_minute == Some(0)
            || self.concurrent_requests == Some(0)
        {
            anyhow::bail!("key_limits must be above 0 (leave a limit out for none)");
        }
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.concurrent_requests.is_none()
    }

    /// How long one token holds a caller's allowance (a minute over the limit).
    fn per_token(&self, tokens_per_minute: u64) -> Duration {
        MINUTE / u32::try_from(tokens_per_minute).unwrap_or(u32::MAX)
    }
}

/// A request let in: holds its concurrent slot until dropped, and then charges its tokens.
pub struct Permit {
    release: Option<Release>,
    tokens: Option<TokenCharge>,
}

impl Permit {
    fn unlimited() -> Permit {
        Permit {
            release: None,
            tokens: None,
        }
    }

    /// Where the request's tokens are told, when its caller has a tokens-per-minute limit.
    pub fn tally(&self) -> Option<&TokenTally> {
        self.tokens.as_ref().map(|charge| &charge.tally)
    }
}

/// The tokens a request used, charged to its caller when its permit drops.
struct TokenCharge {
    tally: TokenTally,
    caller: Caller,
    per_token: Duration,
    to: ChargeTo,
}

enum ChargeTo {
    Memory(Arc<Mutex<MemoryState>>),
    Redis(Arc<Redis>, String),
}

impl TokenCharge {
    fn charge(self) {
        let tokens = self.tally.tokens();
        if tokens == 0 {
            // Nothing used (a request that was not a completion): no store round trip.
            return;
        }
        let cost = self
            .per_token
            .saturating_mul(u32::try_from(tokens).unwrap_or(u32::MAX));
        match self.to {
            ChargeTo::Memory(state) => {
                let now = Instant::now();
                let mut state = lock(&state);
                let tat = state.token_tat.get(&self.caller).copied().unwrap_or(now);
                state.token_tat.insert(self.caller, tat.max(now) + cost);
            }
            ChargeTo::Redis(redis, key) => {
                let micros = u64::try_from(cost.as_micros()).unwrap_or(u64::MAX);
                redis.spawn(move |mut c| async move {
                    CHARGE.key(key).arg(micros).invoke_async::<()>(&mut c).await
                });
            }
        }
    }
}

enum Release {
    Memory(Arc<Mutex<MemoryState>>, Caller),
    Redis(Arc<Redis>, String, String),
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(charge) = self.tokens.take() {
            charge.charge();
        }
        match self.release.take() {
            Some(Release::Memory(state, caller)) => {
                let mut state = lock(&state);
                if let Some(n) = state.in_flight.get_mut(&caller) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        state.in_flight.remove(&caller);
                    }
                }
            }
            Some(Release::Redis(redis, key, lease)) => {
                redis.spawn(move |mut c| async move {
                    redis::cmd("ZREM")
                        .arg(key)
                        .arg(lease)
                        .query_async::<()>(&mut c)
                        .await
                });
            }
            None => {}
        }
    }
}

pub struct KeyLimits {
    config: KeyLimitsConfig,
    backend: Backend,
}

enum Backend {
    Memory(Arc<Mutex<MemoryState>>),
    Redis(Arc<Redis>),
}

#[derive(Default)]
struct MemoryState {
    /// GCRA's theoretical arrival time per caller, of requests and of tokens.
    tat: HashMap<Caller, Instant>,
    token_tat: HashMap<Caller, Instant>,
    in_flight: HashMap<Caller, u32>,
}

fn lock(state: &Mutex<MemoryState>) -> MutexGuard<'_, MemoryState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// KEYS: the caller's GCRA key. ARGV: emission interval and burst, in microseconds and requests.
/// Returns 0 when allowed, else the microseconds until the next request would be. Redis's clock,
/// not the replicas', so replicas whose clocks differ still share one allowance.
static RATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
        local interval = tonumber(ARGV[1])
        local tat = tonumber(redis.call('GET', KEYS[1]) or now)
        if tat < now then tat = now end
        local allow_at = tat + interval - interval * tonumber(ARGV[2])
        if now < allow_at then return allow_at - now end
        redis.call('SET', KEYS[1], tat + interval, 'PX', math.ceil((tat + interval - now) / 1000) + 1)
        return 0
        ",
    )
});

/// KEYS: the caller's tokens GCRA key. ARGV: the window in microseconds. Returns 0 while the caller
/// has tokens left, else the microseconds until it has.
static TOKENS_LEFT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
        local tat = tonumber(redis.call('GET', KEYS[1]) or now)
        local wait = tat - now - tonumber(ARGV[1])
        if wait >= 0 then return wait + 1 end
        return 0
        ",
    )
});

/// KEYS: the caller's tokens GCRA key. ARGV: the cost of what a request used, in microseconds.
static CHARGE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
        local tat = tonumber(redis.call('GET', KEYS[1]) or now)
        if tat < now then tat = now end
        tat = tat + tonumber(ARGV[1])
        redis.call('SET', KEYS[1], tat, 'PX', math.ceil((tat - now) / 1000) + 1)
        ",
    )
});

/// KEYS: the caller's set of leases. ARGV: lease id, limit, lease seconds. Returns 1 when the
/// lease is taken, 0 when the caller is at the limit. Leases of replicas that died expire.
static CONCURRENT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1])
        redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
        if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
        redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
        redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
        return 1
        ",
    )
});

impl KeyLimits {
    pub fn in_memory(config: KeyLimitsConfig) -> KeyLimits {
        KeyLimits {
            config,
            backend: Backend::Memory(Arc::default()),
        }
    }

    pub fn in_redis(config: KeyLimitsConfig, redis: Arc<Redis>) -> KeyLimits {
        KeyLimits {
            config,
            backend: Backend::Redis(redis),
        }
    }

    /// Lets `caller`'s request in, or refuses it with 429 and when to retry.
    pub async fn admit(&self, caller: &Caller) -> Result<Permit, ApiError> {
        if self.config.is_empty() {
            return Ok(Permit::unlimited());
        }
        match &self.backend {
            Backend::Memory(state) => self.admit_in_memory(state, caller, Instant::now()),
            Backend::Redis(redis) => self.admit_in_redis(redis, caller).await,
        }
    }

    fn admit_in_memory(
        &self,
        state: &Arc<Mutex<MemoryState>>,
        caller: &Caller,
        now: Instant,
    ) -> Result<Permit, ApiError> {
        let mut guard = lock(state);
        let tokens = match self.config.tokens_per_minute {
            Some(tpm) => {
                if let Some(tat) = guard.token_tat.get(caller)
                    && let Some(wait) = tat.checked_duration_since(now + MINUTE)
                {
                    return Err(tokens_used_up(wait));
                }
                guard.token_tat.retain(|_, t| *t > now);
                Some(TokenCharge {
                    tally: TokenTally::default(),
                    caller: caller.clone(),
                    per_token: self.config.per_token(tpm),
                    to: ChargeTo::Memory(state.clone()),
                })
            }
            None => None,
        };
        if let Some(rpm) = self.config.requests_per_minute {
            let interval = Duration::from_secs(60) / rpm;
            let tat = guard.tat.get(caller).copied().unwrap_or(now).max(now);
            let allow_at = (tat + interval).checked_sub(interval * rpm).unwrap_or(now);
            if now < allow_at {
                return Err(rate_limited(allow_at - now));
            }
            guard.tat.insert(caller.clone(), tat + interval);
            // Callers whose allowance is full again need no state.
            guard.tat.retain(|_, t| *t > now);
        }
        let release = match self.config.concurrent_requests {
            Some(limit) => {
                let n = guard.in_flight.entry(caller.clone()).or_default();
                if *n >= limit {
                    return Err(too_many_in_flight(limit));
                }
                *n += 1;
                Some(Release::Memory(state.clone(), caller.clone()))
            }
            None => None,
        };
        Ok(Permit { release, tokens })
    }

    async fn admit_in_redis(
        &self,
        redis: &Arc<Redis>,
        caller: &Caller,
    ) -> Result<Permit, ApiError> {
        let tokens = match self.config.tokens_per_minute {
            Some(tpm) => {
                let key = redis.key(&["limits", caller.as_str(), "tpm"]);
                let window = MINUTE.as_micros() as u64;
                let k = key.clone();
                let wait = redis
                    .run(move |mut c| async move {
                        TOKENS_LEFT
                            .key(k)
                            .arg(window)
                            .invoke_async::<u64>(&mut c)
                            .await
                    })
                    .await;
                match wait {
                    Ok(0) => {}
                    Ok(micros) => return Err(tokens_used_up(Duration::from_micros(micros))),
                    Err(e) => return Ok(unchecked(&e)),
                }
                Some(TokenCharge {
                    tally: TokenTally::default(),
                    caller: caller.clone(),
                    per_token: self.config.per_token(tpm),
                    to: ChargeTo::Redis(redis.clone(), key),
                })
            }
            None => None,
        };
        if let Some(rpm) = self.config.requests_per_minute {
            let key = redis.key(&["limits", caller.as_str(), "rpm"]);
            let interval = 60_000_000 / u64::from(rpm);
            let wait = redis
                .run(move |mut c| async move {
                    RATE.key(key)
                        .arg(interval)
                        .arg(rpm)
                        .invoke_async::<u64>(&mut c)
                        .await
                })
                .await;
            match wait {
                Ok(0) => {}
                Ok(micros) => return Err(rate_limited(Duration::from_micros(micros))),
                Err(e) => return Ok(unchecked(&e)),
            }
        }
        let Some(limit) = self.config.concurrent_requests else {
            return Ok(Permit {
                release: None,
                tokens,
            });
        };
        let key = redis.key(&["limits", caller.as_str(), "in-flight"]);
        let lease = format!("{:032x}", rand::random::<u128>());
        let lease_seconds = self.config.concurrent_lease_seconds.max(1);
        let (k, l) = (key.clone(), lease.clone());
        let taken = redis
            .run(move |mut c| async move {
                CONCURRENT
                    .key(k)
                    .arg(l)
                    .arg(limit)
                    .arg(lease_seconds)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
        match taken {
            Ok(1) => Ok(Permit {
                release: Some(Release::Redis(redis.clone(), key, lease)),
                tokens,
            }),
            Ok(_) => Err(too_many_in_flight(limit)),
            Err(e) => Ok(unchecked(&e)),
        }
    }
}

/// The store did not answer: the request goes through unlimited (see the module's note).
fn unchecked(error: &crate::store::Unavailable) -> Permit {
    tracing::warn!(error = %error, "per-key limits unchecked: the store is unreachable");
    Permit::unlimited()
}

fn rate_limited(wait: Duration) -> ApiError {
    used_up("requests", wait)
}

fn tokens_used_up(wait: Duration) -> ApiError {
    used_up("tokens", wait)
}

fn used_up(what: &str, wait: Duration) -> ApiError {
    // Whole seconds, rounded up: a client retrying then is let in.
    let seconds = wait.as_micros().div_ceil(1_000_000).max(1) as u64;
    let mut error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_exceeded",
        format!("this API key's {what} per minute are used up; retry in {seconds} s"),
    );
    error.retry_after = Some(seconds);
    error
}

fn too_many_in_flight(limit: u32) -> ApiError {
    let mut error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_concurrent_requests",
        format!("this API key already has {limit} requests in flight"),
    );
    error.retry_after = Some(1);
    error
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<u32>, concurrent: Option<u32>) -> (KeyLimits, Arc<Mutex<MemoryState>>) {
        with_tokens(rpm, None, concurrent)
    }

    fn with_tokens(
        rpm: Option<u32>,
        tpm: Option<u64>,
        concurrent: Option<u32>,
    ) -> (KeyLimits, Arc<Mutex<MemoryState>>) {
        let state = Arc::<Mutex<MemoryState>>::default();
        let limits = KeyLimits {
            config: KeyLimitsConfig {
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
                concurrent_requests: concurrent,
                concurrent_lease_seconds: 60,
            },
            backend: Backend::Memory(state.clone()),
        };
        (limits, state)
    }

    #[test]
    fn a_minute_of_requests_may_come_at_once_then_they_refill_evenly() {
        let (limits, state) = limits(Some(6), None);
        let (a, b) = (Caller::for_key("a"), Caller::for_key("b"));
        let t0 = Instant::now();
        for _ in 0..6 {
            assert!(limits.admit_in_memory(&state, &a, t0).is_ok());
        }
        let refused = limits.admit_in_memory(&state, &a, t0).err();
        assert_eq!(refused.as_ref().map(|e| e.status.as_u16()), Some(429));
        assert_eq!(refused.and_then(|e| e.retry_after), Some(10));
        // Another key has its own allowance.
        assert!(limits.admit_in_memory(&state, &b, t0).is_ok());
        // One interval (10 s) later, one more.
        let t1 = t0 + Duration::from_secs(10);
        assert!(limits.admit_in_memory(&state, &a, t1).is_ok());
        assert!(limits.admit_in_memory(&state, &a, t1).is_err());
    }

    #[test]
    fn slots_in_flight_return_when_the_permit_is_dropped() {
        let (limits, state) = limits(None, Some(2));
        let a = Caller::public();
        let now = Instant::now();
        let first = limits.admit_in_memory(&state, &a, now);
        let second = limits.admit_in_memory(&state, &a, now);
        assert!(first.is_ok() && second.is_ok());
        assert!(limits.admit_in_memory(&state, &a, now).is_err());
        drop(first);
        let third = limits.admit_in_memory(&state, &a, now);
        assert!(third.is_ok());
        drop(second);
        assert_eq!(lock(&state).in_flight.get(&a), Some(&1));
        drop(third);
        assert!(lock(&state).in_flight.is_empty());
    }

    #[test]
    fn a_key_is_let_in_while_it_has_tokens_left_and_charged_what_it_used() {
        let (limits, state) = with_tokens(None, Some(600), None);
        let (a, b) = (Caller::for_key("a"), Caller::for_key("b"));
        let now = Instant::now();
        // Two requests in flight at once may both be let in: tokens are charged when they end.
        let first = limits.admit_in_memory(&state, &a, now);
        let second = limits.admit_in_memory(&state, &a, now);
        let (Ok(first), Ok(second)) = (first, second) else {
            panic!("a key with its tokens left was refused");
        };
        if let Some(tally) = first.tally() {
            tally.used(500);
        }
        drop(first);
        // 500 of 600 used: still some left.
        let third = limits.admit_in_memory(&state, &a, Instant::now());
        assert!(third.is_ok());
        if let Some(tally) = second.tally() {
            tally.used(400);
        }
        drop(second);
        // 900 used: 300 over the minute's 600, which take 30 s (10 tokens a second) to refill.
        let refused = limits.admit_in_memory(&state, &a, Instant::now()).err();
        assert_eq!(refused.as_ref().map(|e| e.status.as_u16()), Some(429));
        let retry = refused.and_then(|e| e.retry_after);
        assert!(matches!(retry, Some(29..=30)), "{retry:?}");
        // Another key has its own tokens.
        assert!(limits.admit_in_memory(&state, &b, Instant::now()).is_ok());
        // 30 s later the key has tokens again.
        let later = Instant::now() + Duration::from_secs(31);
        assert!(limits.admit_in_memory(&state, &a, later).is_ok());
        drop(third);
    }
}
