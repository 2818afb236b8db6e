//! The delivery queue in front of each backend: where a closed window waits
//! for its [`WindowUploader`]. A sink that is down never blocks sampling:
//!
//! 1. [`DeliveryQueue::submit`] appends the window to a bounded queue and
//!    returns at once. When the queue is full the oldest window is dropped
//!    (even one being retried: the newest data is worth more), counted as
//!    `queue_full` and logged.
//! 2. One tokio task per backend takes the oldest window and uploads it.
//!    A retryable failure ([`super::UploadError::is_retryable`]) waits an
//!    exponential backoff with full jitter (AWS's "full jitter": a uniform
//!    random wait up to `min(max, initial * 2^attempt)`) and tries again,
//!    up to [`RetryPolicy::max_attempts`]; then the window is dropped
//!    (`retries_exhausted`). A final failure drops it at once (`rejected`).
//! 3. [`DeliveryQueue::flush`] (shutdown) waits for the queue to drain,
//!    bounded by the grace period; what is left is dropped (`shutdown`).
//!
//! Every outcome lands in the sink's [`SinkCounters`].

use std::{
    collections::VecDeque,
    hash::{BuildHasher as _, Hasher as _},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use super::{BoxFuture, FlushReport, WindowBatch, WindowUploader, metrics::SinkCounters};

/// Why a window was dropped: the `reason` label of
/// `clrbpf_agent_windows_dropped_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    QueueFull,
    Rejected,
    RetriesExhausted,
    Shutdown,
}

impl DropReason {
    pub fn name(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::Rejected => "rejected",
            Self::RetriesExhausted => "retries_exhausted",
            Self::Shutdown => "shutdown",
        }
    }
}

/// How a queue retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Windows held at most (the one being uploaded included).
    pub capacity: usize,
    /// Attempts per window, the first included.
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 20 windows (5 minutes at the default 15 s interval), 10 attempts,
    /// backoff from 1 s to 30 s.
    fn default() -> Self {
        Self {
            capacity: 20,
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The longest wait before attempt `attempt + 1` (`attempt` >= 1):
    /// `initial * 2^(attempt-1)`, capped at `max_backoff`.
    pub fn backoff_cap(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(30);
        self.initial_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }
}

/// A queued window and its delivery state.
struct Pending {
    /// Tells a window apart from the one that replaced it at the front.
    id: u64,
    batch: Arc<WindowBatch>,
}

#[derive(Default)]
struct QueueState {
    windows: VecDeque<Pending>,
    next_id: u64,
    /// Set by flush's end: the worker stops after its current attempt.
    closed: bool,
}

struct Shared {
    state: Mutex<QueueState>,
    /// Wakes the worker (new window, shutdown).
    work: Notify,
    /// Wakes flush (a window left the queue).
    progress: Notify,
    counters: SinkCounters,
    policy: RetryPolicy,
    name: &'static str,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        // A panic while holding this lock leaves plain data behind: keep going.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_queue_length(&self, state: &QueueState) {
        self.counters
            .queue_length
            .set(i64::try_from(state.windows.len()).unwrap_or(i64::MAX));
    }

    fn drop_window(&self, batch: &WindowBatch, reason: DropReason) {
        self.counters.dropped(reason).inc();
        tracing::warn!(
            sink = self.name,
            reason = reason.name(),
            window_start_unix_ns = batch.start_unix_ns(),
            "window dropped"
        );
    }
}

/// One backend's queue and worker; see the module documentation.
pub struct DeliveryQueue {
    shared: Arc<Shared>,
    worker: tokio::task::JoinHandle<()>,
}

impl DeliveryQueue {
    /// Starts the worker task on the current tokio runtime.
    pub fn spawn(
        uploader: Arc<dyn WindowUploader>,
        policy: RetryPolicy,
        counters: SinkCounters,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(QueueState::default()),
            work: Notify::new(),
            progress: Notify::new(),
            counters,
            policy: RetryPolicy {
                capacity: policy.capacity.max(1),
                max_attempts: policy.max_attempts.max(1),
                ..policy
            },
            name: uploader.name(),
        });
        let worker = tokio::spawn(run_worker(Arc::clone(&shared), uploader));
        Self { shared, worker }
    }

    /// The sink's name.
    pub fn name(&self) -> &'static str {
        self.shared.name
    }

    /// Windows waiting (the one being uploaded included).
    pub fn len(&self) -> usize {
        self.shared.lock().windows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for DeliveryQueue {
    fn drop(&mut self) {
        self.worker.abort();
    }
}

impl DeliveryQueue {
    /// Takes one closed window's batch. Never blocks and never fails: a
    /// backend that cannot keep up drops its oldest windows, counted in the
    /// metrics.
    pub fn submit(&self, batch: Arc<WindowBatch>) {
        let shared = &self.shared;
        let dropped = {
            let mut state = shared.lock();
            if state.closed {
                Some((batch, DropReason::Shutdown))
            } else {
                let id = state.next_id;
                state.next_id += 1;
                state.windows.push_back(Pending { id, batch });
                let overflow = if state.windows.len() > shared.policy.capacity {
                    state.windows.pop_front()
                } else {
                    None
                };
                shared.set_queue_length(&state);
                overflow.map(|pending| (pending.batch, DropReason::QueueFull))
            }
        };
        if let Some((batch, reason)) = dropped {
            shared.drop_window(&batch, reason);
        }
        shared.work.notify_one();
    }

    /// Waits until every window submitted so far is delivered or given up,
    /// for at most `grace`; what is still queued then is dropped and
    /// counted.
    pub fn flush(&self, grace: Duration) -> BoxFuture<'_, FlushReport> {
        Box::pin(async move {
            let shared = &self.shared;
            let deadline = tokio::time::Instant::now() + grace;
            loop {
                // Registered before the check, so no wakeup is missed.
                let progress = shared.progress.notified();
                if shared.lock().windows.is_empty() {
                    break;
                }
                if tokio::time::timeout_at(deadline, progress).await.is_err() {
                    break;
                }
            }
            let abandoned: Vec<Pending> = {
                let mut state = shared.lock();
                state.closed = true;
                let left = state.windows.drain(..).collect();
                shared.set_queue_length(&state);
                left
            };
            shared.work.notify_one();
            for pending in &abandoned {
                shared.drop_window(&pending.batch, DropReason::Shutdown);
            }
            shared.progress.notify_waiters();
            FlushReport {
                abandoned: abandoned.len() as u64,
            }
        })
    }
}

/// The worker: oldest window first, retries, counting.
async fn run_worker(shared: Arc<Shared>, uploader: Arc<dyn WindowUploader>) {
    let mut jitter = Jitter::new();
    loop {
        let work = shared.work.notified();
        let next = {
            let state = shared.lock();
            if state.closed {
                return;
            }
            state
                .windows
                .front()
                .map(|pending| (pending.id, Arc::clone(&pending.batch)))
        };
        let Some((id, batch)) = next else {
            work.await;
            continue;
        };
        let mut attempt = 0u32;
        let outcome = loop {
            attempt += 1;
            let started = Instant::now();
            let result = uploader.upload(Arc::clone(&batch)).await;
            shared
                .counters
                .upload_seconds
                .observe(started.elapsed().as_secs_f64());
            match result {
                Ok(()) => {
                    shared.counters.set_accepting(true);
                    break Outcome::Shipped;
                }
                Err(error) => {
                    shared.counters.failed.inc();
                    shared.counters.set_accepting(false);
                    let retryable = error.is_retryable();
                    tracing::warn!(
                        sink = shared.name,
                        attempt,
                        retryable,
                        error = %crate::agent::metrics::ErrorChain(&error),
                        "window upload failed"
                    );
                    if !retryable {
                        break Outcome::Dropped(DropReason::Rejected);
                    }
                    if attempt >= shared.policy.max_attempts {
                        break Outcome::Dropped(DropReason::RetriesExhausted);
                    }
                }
            }
            let wait = jitter.full(shared.policy.backoff_cap(attempt));
            tokio::time::sleep(wait).await;
            // Dropped from the queue while waiting (it overflowed, or the
            // flush gave up, and was counted then): stop retrying it.
            let state = shared.lock();
            if state.closed || state.windows.front().is_none_or(|front| front.id != id) {
                break Outcome::Gone;
            }
        };
        let mut state = shared.lock();
        if state.windows.front().is_some_and(|front| front.id == id) {
            state.windows.pop_front();
            shared.set_queue_length(&state);
            drop(state);
            if let Outcome::Dropped(reason) = outcome {
                shared.drop_window(&batch, reason);
            }
        } else {
            drop(state);
        }
        // A window dropped from the queue while its upload was under way
        // was counted as dropped then; if the upload went through anyway it
        // also counts as shipped.
        if let Outcome::Shipped = outcome {
            shared.counters.shipped.inc();
        }
        shared.progress.notify_waiters();
    }
}

/// How one window's delivery ended.
enum Outcome {
    Shipped,
    Dropped(DropReason),
    /// Dropped (and counted) by someone else while it was being retried.
    Gone,
}

/// Several backends: each gets every window, on its own queue.
#[derive(Default)]
pub struct FanOut {
    queues: Vec<DeliveryQueue>,
}

impl FanOut {
    pub fn new(queues: Vec<DeliveryQueue>) -> Self {
        Self { queues }
    }

    pub fn queues(&self) -> &[DeliveryQueue] {
        &self.queues
    }
}

impl FanOut {
    /// Hands `batch` to every queue.
    pub fn submit(&self, batch: Arc<WindowBatch>) {
        for queue in &self.queues {
            queue.submit(Arc::clone(&batch));
        }
    }

    /// Flushes every queue at once, each for at most `grace`.
    pub fn flush(&self, grace: Duration) -> BoxFuture<'_, FlushReport> {
        Box::pin(async move {
            let mut report = FlushReport::default();
            // Concurrently: one slow backend must not eat the others' grace.
            let flushes = self.queues.iter().map(|queue| queue.flush(grace)).collect();
            for outcome in join_all(flushes).await {
                report = report.merge(outcome);
            }
            report
        })
    }
}

/// Polls every future to completion, concurrently, on the current task.
async fn join_all<T>(futures: Vec<BoxFuture<'_, T>>) -> Vec<T> {
    let mut futures: Vec<Option<BoxFuture<'_, T>>> = futures.into_iter().map(Some).collect();
    let mut results: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, result) in futures.iter_mut().zip(results.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => {
                        *result = Some(value);
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    results.into_iter().flatten().collect()
}

/// Random waits for the backoff: xorshift64*, seeded from the standard
/// library's per-process random hasher keys. Not cryptographic; it only
/// keeps a fleet of agents from retrying in step.
struct Jitter(u64);

impl Jitter {
    fn new() -> Self {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(crate::profile::monotonic_ns());
        Self(hasher.finish() | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A uniform wait in `[0, cap]`.
    fn full(&mut self, cap: Duration) -> Duration {
        let fraction = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        cap.mul_f64(fraction)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::agent::{UploadError, metrics::AgentMetrics, test_support::window};

    /// Fails the first `failures` attempts with a 503, then records the
    /// windows it delivered.
    struct FlakyUploader {
        failures: AtomicU32,
        final_status: Option<u16>,
        delivered: Mutex<Vec<i64>>,
        hold: Option<Arc<Notify>>,
    }

    impl FlakyUploader {
        fn new(failures: u32) -> Self {
            Self {
                failures: AtomicU32::new(failures),
                final_status: None,
                delivered: Mutex::new(Vec::new()),
                hold: None,
            }
        }
        fn delivered(&self) -> Vec<i64> {
            self.delivered.lock().unwrap().clone()
        }
    }

    impl WindowUploader for FlakyUploader {
        fn name(&self) -> &'static str {
            "test"
        }
        fn upload(&self, batch: Arc<WindowBatch>) -> BoxFuture<'_, Result<(), UploadError>> {
            Box::pin(async move {
                if let Some(hold) = &self.hold {
                    hold.notified().await;
                }
                if let Some(status) = self.final_status {
                    return Err(UploadError::Status {
                        sink: "test",
                        status,
                        body: String::new(),
                    });
                }
                let failing = self
                    .failures
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if failing {
                    return Err(UploadError::Status {
                        sink: "test",
                        status: 503,
                        body: "down".into(),
                    });
                }
                self.delivered.lock().unwrap().push(batch.start_unix_ns());
                Ok(())
            })
        }
    }

    fn fast_policy(capacity: usize, max_attempts: u32) -> RetryPolicy {
        RetryPolicy {
            capacity,
            max_attempts,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(5),
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.backoff_cap(1), Duration::from_secs(1));
        assert_eq!(policy.backoff_cap(2), Duration::from_secs(2));
        assert_eq!(policy.backoff_cap(5), Duration::from_secs(16));
        assert_eq!(policy.backoff_cap(6), Duration::from_secs(30));
        assert_eq!(policy.backoff_cap(u32::MAX), Duration::from_secs(30));
        let mut jitter = Jitter::new();
        let waits: Vec<Duration> = (0..200)
            .map(|_| jitter.full(Duration::from_secs(8)))
            .collect();
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(8)));
        assert!(waits.iter().any(|w| *w < Duration::from_secs(2)));
        assert!(waits.iter().any(|w| *w > Duration::from_secs(6)));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn retries_until_the_sink_recovers() {
        let metrics = AgentMetrics::new();
        let uploader = Arc::new(FlakyUploader::new(3));
        let queue = DeliveryQueue::spawn(
            uploader.clone(),
            fast_policy(4, 10),
            metrics.sink_counters("test"),
        );
        queue.submit(Arc::new(window(1)));
        queue.submit(Arc::new(window(2)));
        let report = queue.flush(Duration::from_secs(10)).await;
        assert_eq!(report.abandoned, 0);
        assert_eq!(uploader.delivered(), [1_000_000_000, 2_000_000_000]);
        let counters = metrics.sink_counters("test");
        assert_eq!(counters.shipped.get(), 2);
        assert_eq!(counters.failed.get(), 3);
        assert_eq!(counters.queue_length.get(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_queue_drops_the_oldest_and_never_blocks() {
        let metrics = AgentMetrics::new();
        let hold = Arc::new(Notify::new());
        let uploader = Arc::new(FlakyUploader {
            hold: Some(hold.clone()),
            ..FlakyUploader::new(0)
        });
        let queue = DeliveryQueue::spawn(
            uploader.clone(),
            fast_policy(3, 10),
            metrics.sink_counters("test"),
        );
        for second in 1..=6 {
            queue.submit(Arc::new(window(second)));
            tokio::task::yield_now().await;
        }
        let counters = metrics.sink_counters("test");
        assert_eq!(counters.queue_length.get(), 3);
        assert_eq!(counters.dropped(DropReason::QueueFull).get(), 3);
        // Release the uploader: window 1 was in flight when it was dropped
        // (it still arrives and counts as shipped), then 4, 5, 6.
        let releaser = tokio::spawn(async move {
            loop {
                hold.notify_one();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let report = queue.flush(Duration::from_secs(10)).await;
        releaser.abort();
        assert_eq!(report.abandoned, 0);
        assert_eq!(
            uploader.delivered(),
            [1_000_000_000, 4_000_000_000, 5_000_000_000, 6_000_000_000]
        );
        assert_eq!(counters.shipped.get(), 4);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn final_errors_and_exhausted_retries_drop_the_window() {
        let metrics = AgentMetrics::new();
        let rejecting = Arc::new(FlakyUploader {
            final_status: Some(400),
            ..FlakyUploader::new(0)
        });
        let queue = DeliveryQueue::spawn(rejecting, fast_policy(4, 5), metrics.sink_counters("a"));
        queue.submit(Arc::new(window(1)));
        queue.flush(Duration::from_secs(10)).await;
        let counters = metrics.sink_counters("a");
        assert_eq!(counters.dropped(DropReason::Rejected).get(), 1);
        assert_eq!(counters.failed.get(), 1, "a 400 is not retried");

        let down = Arc::new(FlakyUploader::new(u32::MAX));
        let queue = DeliveryQueue::spawn(down, fast_policy(4, 3), metrics.sink_counters("b"));
        queue.submit(Arc::new(window(1)));
        queue.flush(Duration::from_secs(10)).await;
        let counters = metrics.sink_counters("b");
        assert_eq!(counters.dropped(DropReason::RetriesExhausted).get(), 1);
        assert_eq!(counters.failed.get(), 3);
        assert_eq!(counters.shipped.get(), 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn flush_gives_up_after_the_grace_period() {
        let metrics = AgentMetrics::new();
        let down = Arc::new(FlakyUploader::new(u32::MAX));
        let policy = RetryPolicy {
            capacity: 8,
            max_attempts: 1000,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(20),
        };
        let queue = DeliveryQueue::spawn(down, policy, metrics.sink_counters("test"));
        queue.submit(Arc::new(window(1)));
        queue.submit(Arc::new(window(2)));
        let started = Instant::now();
        let report = queue.flush(Duration::from_millis(200)).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(report.abandoned, 2);
        let counters = metrics.sink_counters("test");
        assert_eq!(counters.dropped(DropReason::Shutdown).get(), 2);
        assert_eq!(counters.queue_length.get(), 0);
        // Closed: a late window is dropped, not queued.
        queue.submit(Arc::new(window(3)));
        assert!(queue.is_empty());
        assert_eq!(counters.dropped(DropReason::Shutdown).get(), 3);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn fan_out_delivers_to_every_sink() {
        let metrics = AgentMetrics::new();
        let a = Arc::new(FlakyUploader::new(0));
        let b = Arc::new(FlakyUploader::new(1));
        let fan_out = FanOut::new(vec![
            DeliveryQueue::spawn(a.clone(), fast_policy(4, 5), metrics.sink_counters("a")),
            DeliveryQueue::spawn(b.clone(), fast_policy(4, 5), metrics.sink_counters("b")),
        ]);
        fan_out.submit(Arc::new(window(7)));
        let report = fan_out.flush(Duration::from_secs(10)).await;
        assert_eq!(report.abandoned, 0);
        assert_eq!(a.delivered(), [7_000_000_000]);
        assert_eq!(b.delivered(), [7_000_000_000]);
    }
}
