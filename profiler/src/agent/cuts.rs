//! Where the agent's loop cuts the pipeline's stream of samples: at the end
//! of each upload window, and at both ends of every on-demand profile
//! asked for on `/debug/pprof/profile`. Each cut hands out the profile of
//! the span since the previous one (a part); a window's profile is the
//! merge of its parts, and so is a pull's. Without pulls, a window is one
//! part and nothing is merged.
//!
//! A pull keeps only the samples of the selected processes (the
//! `--exe`/`--container-id`/`--k8s-namespace` selection the sinks apply),
//! merged into one profile as its parts arrive, of at most
//! [`MAX_PULL_SAMPLES`] distinct samples. It ends as soon as its client
//! goes away (its reply channel closes), and the one-pull-at-a-time slot it
//! holds is freed then.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot};

use super::{
    BoxFuture,
    config::{ProcessSelection, window_start},
    http::PullProfiler,
};
use crate::{
    export::{
        ExportError,
        sink::{ClosedWindow, ProfileSink},
    },
    pipeline::{SYMBOLIZE_DELAY, driver::WindowPolicy},
    profile::{Aggregator, Profile, ProfileSample},
};

/// Distinct samples (stack and labels) a pull holds at most: a pull spans
/// several windows, and whatever its client asks, it holds no more than
/// about a busy window's profile. Samples past it are left out and said so
/// in the profile's comments.
pub const MAX_PULL_SAMPLES: usize = 100_000;

/// A profile asked for on the HTTP endpoint, and where its answer goes.
pub struct PullRequest {
    pub duration: Duration,
    pub reply: oneshot::Sender<Result<Profile, String>>,
    /// The endpoint's one-pull-at-a-time slot, held while the pull runs.
    pub slot: OwnedSemaphorePermit,
}

/// The HTTP side of on-demand profiles: sends the request to the loop and
/// waits for its answer.
pub struct LoopPuller {
    requests: mpsc::Sender<PullRequest>,
}

impl LoopPuller {
    /// The puller, and the receiver the loop polls.
    pub fn new() -> (Self, mpsc::Receiver<PullRequest>) {
        // The endpoint takes one pull at a time; a second slot lets a
        // request wait while the loop answers the previous one.
        let (requests, receiver) = mpsc::channel(2);
        (Self { requests }, receiver)
    }
}

impl PullProfiler for LoopPuller {
    fn profile(
        &self,
        duration: Duration,
        slot: OwnedSemaphorePermit,
    ) -> BoxFuture<'_, Result<Profile, String>> {
        Box::pin(async move {
            // Dropping this future (the client went away) drops `answer`:
            // the loop sees the reply closed and ends the pull.
            let (reply, answer) = oneshot::channel();
            self.requests
                .send(PullRequest {
                    duration,
                    reply,
                    slot,
                })
                .await
                .map_err(|_| "the agent is stopping".to_owned())?;
            answer
                .await
                .map_err(|_| "the agent stopped before the profile was done".to_owned())?
        })
    }
}

/// The client of one on-demand profile, waiting for it: the sink a pull's
/// window goes to.
pub struct PullReply(Option<oneshot::Sender<Result<Profile, String>>>);

impl PullReply {
    /// Whether the client went away (or was answered).
    fn is_closed(&self) -> bool {
        self.0.as_ref().is_none_or(oneshot::Sender::is_closed)
    }

    /// Answers with an error instead of a profile.
    fn refuse(&mut self, why: &str) {
        if let Some(reply) = self.0.take() {
            // The requester may have gone (a closed connection): nothing
            // to do.
            let _ = reply.send(Err(why.to_owned()));
        }
    }
}

impl ProfileSink for PullReply {
    /// Answers the client with the pull's profile (once).
    fn submit(&mut self, window: ClosedWindow) -> Result<(), ExportError> {
        if let Some(reply) = self.0.take() {
            // The requester may have gone (a closed connection): nothing
            // to do.
            let _ = reply.send(Ok(window.profile));
        }
        Ok(())
    }
}

struct ActivePull {
    from: SystemTime,
    to: SystemTime,
    /// The selected samples of the parts so far, merged.
    collected: Option<Profile>,
    /// Distinct samples left out past [`MAX_PULL_SAMPLES`].
    left_out: usize,
    reply: PullReply,
    _slot: OwnedSemaphorePermit,
}

impl ActivePull {
    /// Adds the selected samples of `part`.
    fn add(&mut self, part: &Profile, selection: &ProcessSelection) {
        let selected = rebuild(
            part,
            part.samples
                .iter()
                .filter(|s| selection.selects_labels(&s.labels)),
        );
        let mut merged = match self.collected.take() {
            None => selected,
            Some(collected) => {
                let start = collected.start_unix_ns;
                Aggregator::merge(&[collected, selected], start, 0).unwrap_or_default()
            }
        };
        if merged.samples.len() > MAX_PULL_SAMPLES {
            self.left_out += merged.samples.len() - MAX_PULL_SAMPLES;
            merged = rebuild(&merged, merged.samples.iter().take(MAX_PULL_SAMPLES));
        }
        self.collected = Some(merged);
    }
}

/// `profile` with only `samples` (some of its own) and the frames they
/// use: nothing of a sample left out stays in it.
fn rebuild<'a>(profile: &Profile, samples: impl Iterator<Item = &'a ProfileSample>) -> Profile {
    let mut aggregator = Aggregator::new(profile.sample_types.clone());
    let mut stack = Vec::new();
    for sample in samples {
        stack.clear();
        stack.extend(
            sample
                .stack
                .iter()
                .filter_map(|&i| profile.frames.get(i as usize))
                .map(|frame| aggregator.intern(frame)),
        );
        aggregator.add(&stack, sample.labels.clone(), &sample.values);
    }
    let mut rebuilt = aggregator.take(
        profile.period_type.clone(),
        profile.period,
        profile.start_unix_ns,
        profile.duration_ns,
    );
    rebuilt.default_sample_type = profile.default_sample_type;
    rebuilt.comments.clone_from(&profile.comments);
    rebuilt.main_module.clone_from(&profile.main_module);
    rebuilt
}

/// The cut points and the parts waiting to be merged.
pub struct Cuts {
    interval: Duration,
    /// The end of the last cut.
    last: SystemTime,
    window_from: SystemTime,
    next_window: SystemTime,
    window_parts: Vec<Profile>,
    pulls: Vec<ActivePull>,
    /// The processes a pull keeps.
    selection: ProcessSelection,
}

fn unix_ns(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl Cuts {
    /// Windows of `interval` on wall-clock boundaries, the first from `now`
    /// to the next boundary; pulls keep the processes of `selection`.
    pub fn new(now: SystemTime, interval: Duration, selection: ProcessSelection) -> Self {
        Self {
            interval,
            last: now,
            window_from: now,
            next_window: window_start(now, interval) + interval,
            window_parts: Vec::new(),
            pulls: Vec::new(),
            selection,
        }
    }

    /// A pull from `now` for its duration (none if its client is gone).
    pub fn add_pull(&mut self, now: SystemTime, request: PullRequest) {
        let PullRequest {
            duration,
            reply,
            slot,
        } = request;
        if reply.is_closed() {
            return;
        }
        self.pulls.push(ActivePull {
            from: now.max(self.last),
            to: now.max(self.last) + duration,
            collected: None,
            left_out: 0,
            reply: PullReply(Some(reply)),
            _slot: slot,
        });
    }

    /// Pulls running now (their clients still waiting).
    pub fn running_pulls(&self) -> usize {
        self.pulls.len()
    }

    /// Ends the pulls whose clients went away, freeing what they hold.
    fn drop_abandoned(&mut self) {
        self.pulls.retain(|pull| !pull.reply.is_closed());
    }

    /// The next point to cut at: a window's end, or a pull's start or end.
    fn next_point(&self) -> SystemTime {
        self.pulls
            .iter()
            .flat_map(|p| [p.from, p.to])
            .filter(|&t| t > self.last)
            .fold(self.next_window, SystemTime::min)
    }

    /// Makes every cut whose point is at least `delay` ago (its samples
    /// are all in), answers the pulls that ended and returns the windows
    /// that closed.
    pub fn cut_due(
        &mut self,
        now: SystemTime,
        delay: Duration,
        take: &mut impl FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Vec<ClosedWindow> {
        self.drop_abandoned();
        let mut closed = Vec::new();
        loop {
            let at = self.next_point();
            if now < at + delay {
                return closed;
            }
            closed.extend(self.cut(at, take));
        }
    }

    /// Cuts at `at`: the part `[last, at)` goes to the current window and to
    /// the pulls that cover it; a window or pull that ends at `at` is
    /// merged and handed out.
    fn cut(
        &mut self,
        at: SystemTime,
        take: &mut impl FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Option<ClosedWindow> {
        let part = take(self.last, at);
        for pull in &mut self.pulls {
            if pull.from <= self.last && at <= pull.to {
                pull.add(&part, &self.selection);
            }
        }
        self.last = at;
        self.window_parts.push(part);
        let (ended, going): (Vec<ActivePull>, Vec<ActivePull>) = std::mem::take(&mut self.pulls)
            .into_iter()
            .partition(|p| p.to <= at);
        self.pulls = going;
        for pull in ended {
            let span = pull.to.duration_since(pull.from).unwrap_or_default();
            answer(pull, span);
        }
        if at < self.next_window {
            return None;
        }
        let window = self.close_window(at);
        self.next_window += self.interval;
        while self.next_window <= at {
            self.next_window += self.interval;
        }
        Some(window)
    }

    fn close_window(&mut self, at: SystemTime) -> ClosedWindow {
        let duration = at.duration_since(self.window_from).unwrap_or_default();
        let parts = std::mem::take(&mut self.window_parts);
        let start = self.window_from;
        self.window_from = at;
        let profile = if parts.len() == 1 {
            parts.into_iter().next().unwrap_or_default()
        } else {
            Aggregator::merge(
                &parts,
                unix_ns(start),
                i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX),
            )
            .unwrap_or_default()
        };
        ClosedWindow {
            profile,
            start,
            duration,
        }
    }

    /// At the end: the last part up to `end`; the pulls still running get
    /// what they have (a shorter profile); the last window is returned.
    pub fn finish(
        &mut self,
        end: SystemTime,
        take: &mut impl FnMut(SystemTime, SystemTime) -> Profile,
    ) -> ClosedWindow {
        self.drop_abandoned();
        let end = end.max(self.last);
        let part = take(self.last, end);
        for pull in &mut self.pulls {
            if pull.from <= self.last {
                pull.add(&part, &self.selection);
            }
        }
        self.window_parts.push(part);
        for pull in std::mem::take(&mut self.pulls) {
            let span = end.duration_since(pull.from).unwrap_or_default();
            answer(pull, span);
        }
        self.close_window(end)
    }
}

impl WindowPolicy for Cuts {
    /// The cuts whose point is [`SYMBOLIZE_DELAY`] ago: the samples
    /// before it are all in.
    fn due(
        &mut self,
        now: SystemTime,
        take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Vec<ClosedWindow> {
        self.cut_due(now, SYMBOLIZE_DELAY, &mut |from, to| take(from, to))
    }

    fn last(
        &mut self,
        end: SystemTime,
        take: &mut dyn FnMut(SystemTime, SystemTime) -> Profile,
    ) -> ClosedWindow {
        self.finish(end, &mut |from, to| take(from, to))
    }
}

fn answer(pull: ActivePull, span: Duration) {
    let ActivePull {
        from,
        to: _,
        collected,
        left_out,
        mut reply,
        _slot,
    } = pull;
    let Some(mut profile) = collected else {
        reply.refuse("the agent stopped before the profile began");
        return;
    };
    profile.start_unix_ns = unix_ns(from);
    profile.duration_ns = i64::try_from(span.as_nanos()).unwrap_or(i64::MAX);
    if left_out > 0 {
        profile.comments.push(format!(
            "{left_out} distinct samples left out: a pull holds at most {MAX_PULL_SAMPLES}"
        ));
    }
    let window = ClosedWindow {
        profile,
        start: from,
        duration: span,
    };
    // A reply never fails.
    let _ = reply.submit(window);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::Semaphore;

    use super::*;
    use crate::profile::{Frame, Label, ValueType, label_keys};

    fn pull_request(
        duration: Duration,
    ) -> (
        PullRequest,
        oneshot::Receiver<Result<Profile, String>>,
        Arc<Semaphore>,
    ) {
        let slots = Arc::new(Semaphore::new(1));
        let slot = Arc::clone(&slots).try_acquire_owned().unwrap();
        let (reply, answer) = oneshot::channel();
        let request = PullRequest {
            duration,
            reply,
            slot,
        };
        (request, answer, slots)
    }

    fn cuts(t0: SystemTime, interval: Duration) -> Cuts {
        Cuts::new(t0, interval, ProcessSelection::default())
    }

    /// A part with one sample of value `ms` named after its span.
    fn part(from: SystemTime, to: SystemTime) -> Profile {
        let mut a = Aggregator::new(vec![ValueType::new("cpu", "nanoseconds")]);
        let f = a.intern(&Frame::synthetic("work"));
        let ms = to.duration_since(from).unwrap_or_default().as_millis() as i64;
        a.add(&[f], vec![], &[ms]);
        a.take(None, 1, unix_ns(from), 0)
    }

    fn total(p: &Profile) -> i64 {
        p.samples.iter().map(|s| s.values[0]).sum()
    }

    #[test]
    fn windows_are_cut_on_wall_clock_boundaries() {
        let t0 = UNIX_EPOCH + Duration::from_millis(12_300);
        let mut cuts = cuts(t0, Duration::from_secs(5));
        let mut take = |a, b| part(a, b);
        let delay = Duration::from_millis(500);
        assert!(
            cuts.cut_due(t0 + Duration::from_secs(3), delay, &mut take)
                .is_empty()
        );
        let closed = cuts.cut_due(UNIX_EPOCH + Duration::from_secs(21), delay, &mut take);
        assert_eq!(closed.len(), 2, "[12.3, 15) and [15, 20)");
        assert_eq!(closed[0].duration, Duration::from_millis(2_700));
        assert_eq!(closed[1].start, UNIX_EPOCH + Duration::from_secs(15));
        assert_eq!(total(&closed[1].profile), 5_000);
    }

    #[test]
    fn a_pull_gets_its_span_and_the_windows_stay_whole() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let mut cuts = cuts(t0, Duration::from_secs(10));
        let mut take = |a, b| part(a, b);
        let delay = Duration::from_millis(500);
        let (request, mut answer, slots) = pull_request(Duration::from_secs(6));
        cuts.add_pull(t0 + Duration::from_secs(7), request);
        let closed = cuts.cut_due(t0 + Duration::from_secs(12), delay, &mut take);
        assert_eq!(closed.len(), 1);
        assert_eq!(
            total(&closed[0].profile),
            10_000,
            "the window [100, 110) is whole although cut at 107"
        );
        assert_eq!(closed[0].profile.duration_ns, 10_000_000_000);
        assert!(answer.try_recv().is_err(), "the pull runs to 113");
        let closed = cuts.cut_due(t0 + Duration::from_secs(21), delay, &mut take);
        let pulled = answer.try_recv().expect("answered").expect("a profile");
        assert_eq!(
            slots.available_permits(),
            1,
            "the slot is free once answered"
        );
        assert_eq!(total(&pulled), 6_000, "[107, 113)");
        assert_eq!(pulled.duration_ns, 6_000_000_000);
        assert_eq!(pulled.start_unix_ns, 107_000_000_000);
        assert_eq!(total(&closed[0].profile), 10_000, "[110, 120)");
    }

    #[test]
    fn the_end_answers_running_pulls_with_what_they_have() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let mut cuts = cuts(t0, Duration::from_secs(10));
        let mut take = |a, b| part(a, b);
        let (request, mut answer, _slots) = pull_request(Duration::from_secs(30));
        cuts.add_pull(t0 + Duration::from_secs(2), request);
        cuts.cut_due(t0 + Duration::from_secs(3), Duration::ZERO, &mut take);
        let last = cuts.finish(t0 + Duration::from_secs(5), &mut take);
        assert_eq!(total(&last.profile), 5_000);
        let pulled = answer.try_recv().expect("answered").expect("a profile");
        assert_eq!(total(&pulled), 3_000);
    }

    /// A part with one sample per executable, each with a frame of its
    /// own.
    fn part_of(executables: &[&str]) -> Profile {
        let mut a = Aggregator::new(vec![ValueType::new("cpu", "nanoseconds")]);
        for exe in executables {
            let f = a.intern(&Frame::synthetic(&format!("{exe}.Main")));
            let labels = vec![Label::str(label_keys::PROCESS_EXECUTABLE_NAME, *exe)];
            a.add(&[f], labels, &[1]);
        }
        a.take(None, 1, 0, 0)
    }

    #[test]
    fn a_pull_holds_only_the_selected_processes() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let selection = ProcessSelection {
            executables: vec!["shop".into()],
            ..Default::default()
        };
        let mut cuts = Cuts::new(t0, Duration::from_secs(10), selection);
        let mut take = |_, _| part_of(&["shop", "billing"]);
        let (request, mut answer, _slots) = pull_request(Duration::from_secs(2));
        cuts.add_pull(t0 + Duration::from_secs(1), request);
        cuts.cut_due(t0 + Duration::from_secs(4), Duration::ZERO, &mut take);
        let pulled = answer.try_recv().expect("answered").expect("a profile");
        assert_eq!(pulled.samples.len(), 1);
        let names: Vec<&str> = pulled.frames.iter().map(|f| &*f.name).collect();
        assert_eq!(names, ["shop.Main"], "no frame of another process");
    }

    #[test]
    fn a_pull_whose_client_left_ends_and_frees_its_slot() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let mut cuts = cuts(t0, Duration::from_secs(10));
        let mut take = |a, b| part(a, b);
        let (request, answer, slots) = pull_request(Duration::from_secs(30));
        cuts.add_pull(t0 + Duration::from_secs(1), request);
        cuts.cut_due(t0 + Duration::from_secs(2), Duration::ZERO, &mut take);
        assert_eq!((cuts.running_pulls(), slots.available_permits()), (1, 0));
        drop(answer);
        cuts.cut_due(t0 + Duration::from_secs(3), Duration::ZERO, &mut take);
        assert_eq!((cuts.running_pulls(), slots.available_permits()), (0, 1));
        // A request whose client left while it waited for the loop.
        let (request, answer, slots) = pull_request(Duration::from_secs(30));
        drop(answer);
        cuts.add_pull(t0 + Duration::from_secs(3), request);
        assert_eq!((cuts.running_pulls(), slots.available_permits()), (0, 1));
    }

    #[test]
    fn a_pull_holds_a_bounded_number_of_samples() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let mut cuts = cuts(t0, Duration::from_secs(10));
        let mut take = |_, _| {
            let mut a = Aggregator::new(vec![ValueType::new("cpu", "nanoseconds")]);
            for n in 0..MAX_PULL_SAMPLES + 5 {
                let f = a.intern(&Frame::synthetic(&format!("f{n}")));
                a.add(&[f], vec![], &[1]);
            }
            a.take(None, 1, 0, 0)
        };
        let (request, mut answer, _slots) = pull_request(Duration::from_secs(2));
        cuts.add_pull(t0, request);
        cuts.cut_due(t0 + Duration::from_secs(3), Duration::ZERO, &mut take);
        let pulled = answer.try_recv().expect("answered").expect("a profile");
        assert_eq!(pulled.samples.len(), MAX_PULL_SAMPLES);
        assert_eq!(
            pulled.frames.len(),
            MAX_PULL_SAMPLES,
            "frames of the kept samples only"
        );
        assert!(
            pulled
                .comments
                .iter()
                .any(|c| c.contains("5 distinct samples left out")),
            "{:?}",
            pulled.comments
        );
    }
}
