//! Where the agent's loop cuts the pipeline's stream of samples: at the end
//! of each upload window, and at both ends of every on-demand profile
//! asked for on `/debug/pprof/profile`. Each cut hands out the profile of
//! the span since the previous one (a part); a window's profile is the
//! merge of its parts, and so is a pull's. Without pulls, a window is one
//! part and nothing is merged.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use super::{BoxFuture, config::window_start, http::PullProfiler};
use crate::profile::{Aggregator, Profile};

/// A profile asked for on the HTTP endpoint, and where its answer goes.
pub struct PullRequest {
    pub duration: Duration,
    pub reply: oneshot::Sender<Result<Profile, String>>,
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
    fn profile(&self, duration: Duration) -> BoxFuture<'_, Result<Profile, String>> {
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            self.requests
                .send(PullRequest { duration, reply })
                .await
                .map_err(|_| "the agent is stopping".to_owned())?;
            answer
                .await
                .map_err(|_| "the agent stopped before the profile was done".to_owned())?
        })
    }
}

struct ActivePull {
    from: SystemTime,
    to: SystemTime,
    parts: Vec<Profile>,
    reply: oneshot::Sender<Result<Profile, String>>,
}

/// A closed upload window.
pub struct Window {
    pub profile: Profile,
    pub start: SystemTime,
    pub duration: Duration,
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
}

fn unix_ns(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl Cuts {
    /// Windows of `interval` on wall-clock boundaries, the first from `now`
    /// to the next boundary.
    pub fn new(now: SystemTime, interval: Duration) -> Self {
        Self {
            interval,
            last: now,
            window_from: now,
            next_window: window_start(now, interval) + interval,
            window_parts: Vec::new(),
            pulls: Vec::new(),
        }
    }

    /// A pull from `now` for its duration.
    pub fn add_pull(&mut self, now: SystemTime, request: PullRequest) {
        self.pulls.push(ActivePull {
            from: now.max(self.last),
            to: now.max(self.last) + request.duration,
            parts: Vec::new(),
            reply: request.reply,
        });
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
    ) -> Vec<Window> {
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
    ) -> Option<Window> {
        let part = take(self.last, at);
        for pull in &mut self.pulls {
            if pull.from <= self.last && at <= pull.to {
                pull.parts.push(part.clone());
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

    fn close_window(&mut self, at: SystemTime) -> Window {
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
        Window {
            profile,
            start,
            duration,
        }
    }

    /// At the end: the last part up to `end`; the pulls still running get
    /// what they have (a shorter profile); the last window is returned.
    pub fn finish(
        mut self,
        end: SystemTime,
        take: &mut impl FnMut(SystemTime, SystemTime) -> Profile,
    ) -> Window {
        let end = end.max(self.last);
        let part = take(self.last, end);
        for pull in &mut self.pulls {
            if pull.from <= self.last {
                pull.parts.push(part.clone());
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

fn answer(pull: ActivePull, span: Duration) {
    let profile = Aggregator::merge(
        &pull.parts,
        unix_ns(pull.from),
        i64::try_from(span.as_nanos()).unwrap_or(i64::MAX),
    )
    .ok_or_else(|| "the agent stopped before the profile began".to_owned());
    // The requester may have gone (a closed connection): nothing to do.
    let _ = pull.reply.send(profile);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{Frame, ValueType};

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
        let mut cuts = Cuts::new(t0, Duration::from_secs(5));
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
        let mut cuts = Cuts::new(t0, Duration::from_secs(10));
        let mut take = |a, b| part(a, b);
        let delay = Duration::from_millis(500);
        let (reply, mut answer) = oneshot::channel();
        cuts.add_pull(
            t0 + Duration::from_secs(7),
            PullRequest {
                duration: Duration::from_secs(6),
                reply,
            },
        );
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
        assert_eq!(total(&pulled), 6_000, "[107, 113)");
        assert_eq!(pulled.duration_ns, 6_000_000_000);
        assert_eq!(pulled.start_unix_ns, 107_000_000_000);
        assert_eq!(total(&closed[0].profile), 10_000, "[110, 120)");
    }

    #[test]
    fn the_end_answers_running_pulls_with_what_they_have() {
        let t0 = UNIX_EPOCH + Duration::from_secs(100);
        let mut cuts = Cuts::new(t0, Duration::from_secs(10));
        let mut take = |a, b| part(a, b);
        let (reply, mut answer) = oneshot::channel();
        cuts.add_pull(
            t0 + Duration::from_secs(2),
            PullRequest {
                duration: Duration::from_secs(30),
                reply,
            },
        );
        cuts.cut_due(t0 + Duration::from_secs(3), Duration::ZERO, &mut take);
        let last = cuts.finish(t0 + Duration::from_secs(5), &mut take);
        assert_eq!(total(&last.profile), 5_000);
        let pulled = answer.try_recv().expect("answered").expect("a profile");
        assert_eq!(total(&pulled), 3_000);
    }
}
