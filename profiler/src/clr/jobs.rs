//! The few threads that talk to runtimes for every .NET process: starting
//! and stopping EventPipe sessions, perf map attaches, method rundowns.
//! Each of those waits on a runtime that may answer late or never (bounded
//! by the diagnostic client's deadline), so it cannot run on the recording
//! loop; a thread per job, though, made a node of fifty .NET processes
//! start a hundred threads at once. Jobs queue here for at most
//! [`MAX_WORKERS`] threads, started on demand and ended after
//! [`IDLE_EXIT`] without work, so an idle agent holds none.
//!
//! A [`Job`] reads like a `JoinHandle`: [`Job::is_finished`] to poll from
//! the loop, [`Job::join`] to take the result.

use std::{
    collections::VecDeque,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{Arc, Condvar, Mutex, OnceLock},
    time::Duration,
};

/// Threads running jobs at most. A job waits on one runtime for at most
/// the client's deadline (5 s), so four keep fifty attaches within seconds
/// without a runtime that hangs holding up the others for long.
pub const MAX_WORKERS: usize = 4;
/// A worker with nothing to do for this long ends.
const IDLE_EXIT: Duration = Duration::from_secs(10);

type Task = Box<dyn FnOnce() + Send>;

/// The job queue and its workers.
struct Pool {
    state: Mutex<PoolState>,
    work: Condvar,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Task>,
    workers: usize,
    idle: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(PoolState::default()),
        work: Condvar::new(),
    })
}

/// Why a job gave no result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("the job panicked")]
    Panicked,
    #[error("no thread could be started for the job")]
    NoThread,
}

enum Outcome<T> {
    Pending,
    Done(Result<T, JobError>),
    Taken,
}

struct Slot<T> {
    outcome: Mutex<Outcome<T>>,
    done: Condvar,
}

/// A queued or running job; see the module documentation.
pub struct Job<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for Job<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl<T> Job<T> {
    /// Whether [`Self::join`] would return at once.
    pub fn is_finished(&self) -> bool {
        !matches!(*lock(&self.slot.outcome), Outcome::Pending)
    }

    /// Waits for the job and takes its result.
    pub fn join(self) -> Result<T, JobError> {
        let mut outcome = lock(&self.slot.outcome);
        while matches!(*outcome, Outcome::Pending) {
            outcome = self
                .slot
                .done
                .wait(outcome)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        match std::mem::replace(&mut *outcome, Outcome::Taken) {
            Outcome::Done(result) => result,
            Outcome::Pending | Outcome::Taken => Err(JobError::Panicked),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A job's panic is caught before it reaches a lock: poison only means
    // a panic elsewhere, and the state is still whole.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Queues `job` for the pool; a worker starts if none is idle and fewer
/// than [`MAX_WORKERS`] run.
pub fn spawn<T: Send + 'static>(job: impl FnOnce() -> T + Send + 'static) -> Job<T> {
    let slot = Arc::new(Slot {
        outcome: Mutex::new(Outcome::Pending),
        done: Condvar::new(),
    });
    let theirs = Arc::clone(&slot);
    let task: Task = Box::new(move || {
        let result = catch_unwind(AssertUnwindSafe(job)).map_err(|_| JobError::Panicked);
        *lock(&theirs.outcome) = Outcome::Done(result);
        theirs.done.notify_all();
    });
    let pool = pool();
    let mut state = lock(&pool.state);
    state.queue.push_back(task);
    if state.idle == 0 && state.workers < MAX_WORKERS {
        let started = std::thread::Builder::new()
            .name("clrbpf-jobs".to_owned())
            .spawn(work);
        match started {
            Ok(_) => state.workers += 1,
            Err(error) if state.workers == 0 => {
                // Nobody will run it: fail it rather than leave it waiting.
                state.queue.pop_back();
                drop(state);
                tracing::warn!(%error, "cannot start a thread for runtime requests");
                *lock(&slot.outcome) = Outcome::Done(Err(JobError::NoThread));
            }
            Err(_) => {} // the running workers will get to it
        }
    } else {
        pool.work.notify_one();
    }
    Job { slot }
}

/// A worker: runs queued jobs, ends after [`IDLE_EXIT`] without one.
fn work() {
    crate::process::priority::enter_background_thread();
    let pool = pool();
    let mut state = lock(&pool.state);
    loop {
        if let Some(task) = state.queue.pop_front() {
            drop(state);
            task();
            state = lock(&pool.state);
            continue;
        }
        state.idle += 1;
        let (next, timeout) = pool
            .work
            .wait_timeout(state, IDLE_EXIT)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state = next;
        state.idle -= 1;
        if timeout.timed_out() && state.queue.is_empty() {
            state.workers -= 1;
            return;
        }
    }
}

/// Threads of the pool right now.
pub fn workers() -> usize {
    lock(&pool().state).workers
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn many_jobs_run_on_a_few_threads_and_give_their_results() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<Job<usize>> = (0..40)
            .map(|i| {
                let (running, most) = (Arc::clone(&running), Arc::clone(&most));
                spawn(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(5));
                    running.fetch_sub(1, Ordering::SeqCst);
                    i * 2
                })
            })
            .collect();
        let results: Vec<usize> = jobs.into_iter().map(|j| j.join().expect("ran")).collect();
        assert_eq!(results, (0..40).map(|i| i * 2).collect::<Vec<_>>());
        assert!(most.load(Ordering::SeqCst) <= MAX_WORKERS);
        assert!(workers() <= MAX_WORKERS);
    }

    #[test]
    fn a_panicking_job_is_an_error_and_the_pool_goes_on() {
        let bad = spawn(|| -> u32 { panic!("a job that fails") });
        assert_eq!(bad.join(), Err(JobError::Panicked));
        let good = spawn(|| 7);
        crate::stop::wait_until(std::time::Instant::now() + Duration::from_secs(5), || {
            good.is_finished()
        });
        assert!(good.is_finished());
        assert_eq!(good.join(), Ok(7));
    }
}
