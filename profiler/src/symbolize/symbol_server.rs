//! Debug files from symbol servers, off the sampling path: debuginfod
//! (`<url>/buildid/<id>/debuginfo`, the servers of `DEBUGINFOD_URLS` or
//! `--debuginfod-url`) and Microsoft's symbol server protocol (SSQP,
//! `<url>/<file>.dbg/elf-buildid-sym-<id>/<file>.dbg` and
//! `_.debug/elf-buildid-sym-<id>/_.debug`, `--symbol-server`).
//!
//! [`DebugDownloads::request`] queues a build id (never blocks: a full
//! queue drops the request, counted); [`MAX_CONCURRENT`] worker threads
//! ask each server in turn, with a whole-request timeout, reading at most
//! [`DownloadLimits::max_bytes`] into a temporary file of the cache
//! directory, which is believed only when its build id is the one asked
//! for and then lands at `<cache>/.build-id/xx/rest.debug`, the layout
//! [`super::debug_lookup`] reads a `--debug-dir` in. A build id no server
//! had is remembered (`<cache>/.missing/<id>`) and not asked again for
//! [`MISSING_TTL`]. The cache keeps at most
//! [`DownloadLimits::max_cache_bytes`]: the oldest files go first.
//!
//! URLs are logged without their user info or query (where credentials
//! sit).

use std::{
    collections::HashMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, PoisonError,
        mpsc::{self, SyncSender, TrySendError},
    },
    time::{Duration, Instant, SystemTime},
};

use super::{debug_file, debug_lookup};

/// The servers elfutils, perf and gdb ask (space-separated URLs).
pub const DEBUGINFOD_URLS_ENV: &str = "DEBUGINFOD_URLS";

/// Worker threads (downloads at once).
pub const MAX_CONCURRENT: usize = 2;
/// Requests queued at most; past it a request is dropped (and asked again
/// when the file is next opened).
pub const MAX_QUEUED: usize = 256;
/// How long a build id no server had is not asked for again.
pub const MISSING_TTL: Duration = Duration::from_secs(3600);

/// A server and how it lays out its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymbolServer {
    Debuginfod(String),
    Ssqp(String),
}

impl SymbolServer {
    fn base(&self) -> &str {
        match self {
            Self::Debuginfod(url) | Self::Ssqp(url) => url.trim_end_matches('/'),
        }
    }

    /// The URLs of build id `id`'s debug file for the file `file_name`.
    fn urls(&self, file_name: &str, id: &str) -> Vec<String> {
        let base = self.base();
        match self {
            Self::Debuginfod(_) => debug_file::debuginfod_path(id)
                .map(|path| format!("{base}/{path}"))
                .into_iter()
                .collect(),
            Self::Ssqp(_) => debug_file::symbol_store_keys(file_name, id)
                .into_iter()
                .flatten()
                .map(|key| format!("{base}/{key}"))
                .collect(),
        }
    }
}

/// The servers of `DEBUGINFOD_URLS` (space-separated, as elfutils reads it).
pub fn debuginfod_urls_from_env(value: Option<&str>) -> Vec<String> {
    value
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// `url` without user info, query or fragment, for logs.
pub fn redacted(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string()
        }
        Err(_) => "(an unparsable URL)".to_owned(),
    }
}

/// Bounds of the downloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DownloadLimits {
    /// Largest debug file downloaded.
    pub max_bytes: u64,
    /// Whole request, first byte to last.
    pub timeout: Duration,
    /// Bytes the cache directory keeps.
    pub max_cache_bytes: u64,
}

impl Default for DownloadLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 30,
            timeout: Duration::from_secs(60),
            max_cache_bytes: 4 << 30,
        }
    }
}

/// What became of the downloads, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DownloadStats {
    pub requested: u64,
    pub downloaded: u64,
    /// No server had it (or it was remembered as missing).
    pub missing: u64,
    /// Answers refused: over the size bound, another build id, cut off.
    pub refused: u64,
    /// Requests dropped on a full queue.
    pub dropped: u64,
}

#[derive(Default)]
struct Shared {
    /// Build ids asked for and not finished.
    pending: HashMap<String, ()>,
    stats: DownloadStats,
}

/// The download workers and what they finished.
pub struct DownloadState {
    shared: Mutex<Shared>,
    finished: Condvar,
}

/// Debug files fetched from symbol servers into a cache directory.
pub struct DebugDownloads {
    queue: SyncSender<(String, String)>,
    state: Arc<DownloadState>,
    /// Where finished files land, in the build-id layout: a debug dir.
    pub dir: PathBuf,
}

impl DebugDownloads {
    /// Starts the workers; `None` when there is no server or the cache
    /// directory cannot be made.
    pub fn start(
        servers: Vec<SymbolServer>,
        cache_dir: &Path,
        limits: DownloadLimits,
    ) -> Option<Self> {
        if servers.is_empty() {
            return None;
        }
        let dir = cache_dir.join("debug");
        if let Err(e) = fs::create_dir_all(dir.join(".missing")) {
            tracing::warn!("symbol servers off: cannot make {}: {e}", dir.display());
            return None;
        }
        for server in &servers {
            tracing::info!("debug files from {}", redacted(server.base()));
        }
        let (queue, receiver) = mpsc::sync_channel::<(String, String)>(MAX_QUEUED);
        let receiver = Arc::new(Mutex::new(receiver));
        let state = Arc::new(DownloadState {
            shared: Mutex::new(Shared::default()),
            finished: Condvar::new(),
        });
        let servers = Arc::new(servers);
        for index in 0..MAX_CONCURRENT {
            let receiver = receiver.clone();
            let state = state.clone();
            let servers = servers.clone();
            let dir = dir.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("clrbpf-symdl-{index}"))
                .spawn(move || worker(&receiver, &state, &servers, &dir, limits));
            if let Err(e) = spawned {
                tracing::warn!("cannot start a symbol download thread: {e}");
            }
        }
        Some(Self { queue, state, dir })
    }

    /// Asks for build id `id`'s debug file (of the file named
    /// `file_name`), unless it is asked already or known missing.
    pub fn request(&self, id: &str, file_name: &str) {
        if !debug_file::is_build_id(id) || !debug_file::is_plain_file_name(file_name) {
            return;
        }
        let mut shared = self
            .state
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if shared.pending.contains_key(id) {
            return;
        }
        if is_known_missing(&self.dir, id) {
            shared.stats.missing += 1;
            return;
        }
        match self.queue.try_send((id.to_owned(), file_name.to_owned())) {
            Ok(()) => {
                shared.pending.insert(id.to_owned(), ());
                shared.stats.requested += 1;
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                shared.stats.dropped += 1;
            }
        }
    }

    /// Whether build id `id` is being downloaded.
    pub fn is_pending(&self, id: &str) -> bool {
        let shared = self
            .state
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        shared.pending.contains_key(id)
    }

    /// Waits until nothing is pending, or `deadline`.
    pub fn wait_until(&self, deadline: Instant) {
        let mut shared = self
            .state
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while !shared.pending.is_empty() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            shared = self
                .state
                .finished
                .wait_timeout(shared, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    pub fn stats(&self) -> DownloadStats {
        self.state
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stats
    }
}

fn is_known_missing(dir: &Path, id: &str) -> bool {
    fs::metadata(dir.join(".missing").join(id))
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .is_some_and(|age| age < MISSING_TTL)
}

/// What one download gave.
enum Outcome {
    Downloaded,
    Missing,
    Refused,
}

fn worker(
    receiver: &Mutex<mpsc::Receiver<(String, String)>>,
    state: &DownloadState,
    servers: &[SymbolServer],
    dir: &Path,
    limits: DownloadLimits,
) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let Ok(client) = crate::agent::http_client(limits.timeout) else {
        return;
    };
    loop {
        let next = receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv();
        let Ok((id, file_name)) = next else {
            return;
        };
        let outcome = runtime.block_on(fetch(&client, servers, dir, &id, &file_name, limits));
        if matches!(outcome, Outcome::Missing) {
            let _ = fs::write(dir.join(".missing").join(&id), b"");
        }
        trim_cache(dir, limits.max_cache_bytes);
        let mut shared = state.shared.lock().unwrap_or_else(PoisonError::into_inner);
        shared.pending.remove(&id);
        match outcome {
            Outcome::Downloaded => shared.stats.downloaded += 1,
            Outcome::Missing => shared.stats.missing += 1,
            Outcome::Refused => shared.stats.refused += 1,
        }
        state.finished.notify_all();
    }
}

async fn fetch(
    client: &reqwest::Client,
    servers: &[SymbolServer],
    dir: &Path,
    id: &str,
    file_name: &str,
    limits: DownloadLimits,
) -> Outcome {
    let Some(relative) = debug_file::build_id_path(id) else {
        return Outcome::Refused;
    };
    let target = dir.join(relative);
    let mut outcome = Outcome::Missing;
    for server in servers {
        for url in server.urls(file_name, id) {
            match fetch_one(client, &url, dir, id, &target, limits).await {
                Ok(true) => return Outcome::Downloaded,
                Ok(false) => {}
                Err(why) => {
                    tracing::debug!(url = %redacted(&url), "debug file refused: {why}");
                    outcome = Outcome::Refused;
                }
            }
        }
    }
    outcome
}

/// `Ok(true)`: downloaded and in place; `Ok(false)`: not there (404, no
/// answer); `Err`: an answer refused.
async fn fetch_one(
    client: &reqwest::Client,
    url: &str,
    dir: &Path,
    id: &str,
    target: &Path,
    limits: DownloadLimits,
) -> Result<bool, String> {
    let Ok(mut response) = client.get(url).send().await else {
        return Ok(false);
    };
    if !response.status().is_success() {
        return Ok(false);
    }
    if response
        .content_length()
        .is_some_and(|n| n > limits.max_bytes)
    {
        return Err("over the size bound".into());
    }
    let temp = dir.join(format!(".partial-{id}-{}", std::process::id()));
    let mut file = fs::File::create(&temp).map_err(|e| e.to_string())?;
    let mut written: u64 = 0;
    let result = loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                written = written.saturating_add(chunk.len() as u64);
                if written > limits.max_bytes {
                    break Err("over the size bound".to_owned());
                }
                if let Err(e) = file.write_all(&chunk) {
                    break Err(e.to_string());
                }
            }
            Ok(None) => break Ok(()),
            Err(e) => break Err(format!("cut off: {e}")),
        }
    };
    drop(file);
    let checked = result.and_then(|()| {
        let file = fs::File::open(&temp).map_err(|e| e.to_string())?;
        match debug_lookup::build_id_of(&file) {
            Some(got) if got == id => Ok(()),
            _ => Err("another build id".to_owned()),
        }
    });
    if let Err(why) = checked {
        let _ = fs::remove_file(&temp);
        return Err(why);
    }
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    fs::rename(&temp, target).map_err(|e| e.to_string())?;
    Ok(true)
}

/// Removes the oldest debug files until the cache holds at most
/// `max_bytes`.
fn trim_cache(dir: &Path, max_bytes: u64) {
    let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    let Ok(heads) = fs::read_dir(dir.join(".build-id")) else {
        return;
    };
    for head in heads.flatten().take(256) {
        let Ok(entries) = fs::read_dir(head.path()) else {
            continue;
        };
        for entry in entries.flatten().take(4096) {
            if let Ok(meta) = entry.metadata() {
                let time = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                files.push((time, meta.len(), entry.path()));
            }
        }
    }
    let mut total: u64 = files.iter().map(|f| f.1).fold(0, u64::saturating_add);
    files.sort();
    for (_, size, path) in files {
        if total <= max_bytes {
            break;
        }
        if fs::remove_file(&path).is_ok() {
            total = total.saturating_sub(size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_follow_each_protocol_and_logs_hide_credentials() {
        let id = "ab12cd";
        assert_eq!(
            SymbolServer::Debuginfod("https://d.example/".into()).urls("libx.so", id),
            ["https://d.example/buildid/ab12cd/debuginfo"]
        );
        assert_eq!(
            SymbolServer::Ssqp("http://s.example/store".into()).urls("libcoreclr.so", id),
            [
                "http://s.example/store/libcoreclr.so.dbg/elf-buildid-sym-ab12cd/libcoreclr.so.dbg",
                "http://s.example/store/_.debug/elf-buildid-sym-ab12cd/_.debug"
            ]
        );
        assert_eq!(
            redacted("https://user:secret@d.example/x?token=secret"),
            "https://d.example/x"
        );
        assert_eq!(
            debuginfod_urls_from_env(Some(" http://a  https://b ")),
            ["http://a", "https://b"]
        );
    }
}
