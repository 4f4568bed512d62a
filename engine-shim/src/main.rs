//! `engine-shim`: kvmesh's native engine on libtorch, serving a GGUF model over the OpenAI HTTP
//! API with chunked prefill and a paged prefix cache (docs/engine-shim.md).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use engine_shim::cache::KvBlock;
use engine_shim::engine::{BlockStore, Schedule, Stats, Worker};
use engine_shim::evict::{Eviction, Policy};
use engine_shim::gguf::Gguf;
use engine_shim::kvstore::{KvagentStore, Limits, MacKey};
use engine_shim::model::{Llama, WeightType};
use engine_shim::server::{self, App};
use engine_shim::tokenizer::ModelTokenizer;
use hyper_util::rt::{TokioIo, TokioTimer};
use kvmesh_filters::error::{ApiError, ErrorKind};
use serde::Deserialize;
use tokio::sync::Semaphore;

/// Pause after a failed `accept` (EMFILE and the like): retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

#[derive(Parser)]
#[command(
    name = "engine-shim",
    version,
    about = "kvmesh's native libtorch engine (OpenAI API)"
)]
struct Cli {
    /// TOML configuration file (docs/engine-shim.md lists every key).
    #[arg(long, short = 'c', env = "ENGINE_SHIM_CONFIG")]
    config: Option<PathBuf>,
    /// Overrides `model`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Overrides `listen`.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Overrides `cache_blocks`.
    #[arg(long)]
    cache_blocks: Option<usize>,
    /// Overrides `prefill_chunk`.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Overrides `kvagent_url`.
    #[arg(long)]
    kvagent: Option<String>,
    /// Overrides `weights` (`f32`, `bf16` or `q8_0`).
    #[arg(long)]
    weights: Option<String>,
    /// Overrides `max_num_seqs`.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Overrides `max_num_batched_tokens`.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Overrides `kv_pool_tokens`.
    #[arg(long)]
    kv_pool_tokens: Option<usize>,
    /// Overrides `threads`.
    #[arg(long)]
    threads: Option<usize>,
    /// Overrides `kv_mac_key_file`.
    #[arg(long)]
    kv_mac_key_file: Option<PathBuf>,
    /// Overrides `kvagent_token_file`.
    #[arg(long)]
    kvagent_token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Reads a GGUF model and prints its architecture and a tokenized chat prompt.
    Inspect {
        /// The GGUF file.
        model: PathBuf,
    },
}

/// The engine's configuration; every key has a default.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct EngineConfig {
    /// HTTP listen address.
    listen: SocketAddr,
    /// The GGUF file.
    model: PathBuf,
    /// Model name in the API (`model` field, `/v1/models`).
    served_model_name: String,
    /// Longest prompt + completion, tokens (0: the model's context length).
    max_model_len: usize,
    /// `max_tokens` when a request gives none.
    default_max_tokens: usize,
    /// Most prompt tokens of one sequence computed in one step (chunked prefill).
    prefill_chunk: usize,
    /// Most sequences in the running batch (continuous batching).
    max_num_seqs: usize,
    /// Most tokens one step computes: one per decoding sequence, plus at most one prefill
    /// chunk in what is left (must exceed `max_num_seqs`, so prefill always progresses).
    max_num_batched_tokens: usize,
    /// Most tokens of KV the running sequences hold together (~45 KiB each for SmolLM2-135M);
    /// when the batch cannot grow, the newest sequence is preempted and recomputed later. At
    /// least the longest sequence (`max_model_len`); 0: 4x `max_model_len`.
    kv_pool_tokens: usize,
    /// Prefix cache capacity in 16-token blocks (each ~737 KB for SmolLM2-135M).
    cache_blocks: usize,
    /// Most requests waiting; more get 429.
    max_queue: usize,
    /// Largest request body, bytes.
    max_body_bytes: usize,
    /// Most bytes of request bodies being read (and held until tokenised) at once, over all
    /// connections; a body that does not fit gets 429.
    max_body_buffer_bytes: usize,
    /// Most open HTTP connections; one more is answered 429 and closed at once.
    max_connections: usize,
    /// Longest wait for a request's head (also between requests on a kept-alive connection),
    /// milliseconds; then the connection is closed.
    header_read_timeout_ms: u64,
    /// Longest wait for a request's whole body, milliseconds; then 408 and the connection closes.
    body_read_timeout_ms: u64,
    /// libtorch intra-op threads, and candle's for `q8_0` unless `CANDLE_NUM_THREADS` is set
    /// (0: one per CPU). With `q8_0`, a step of decode tokens only runs libtorch on one thread
    /// and candle on these (docs/engine-shim.md, "Decode speed").
    threads: usize,
    /// Matrix weights: `f32` (default: the reference precision), `bf16` (near-tied tokens flip:
    /// it answers the France test prompt wrongly) or `q8_0` (decode tokens through GGML Q8_0
    /// kernels: faster decode, logits 0.985-0.993 correlated with f32's).
    weights: WeightType,
    /// kvagent gRPC URL for spilling and paging in blocks; empty: none.
    kvagent_url: String,
    /// Longest wait for one page-in from kvagent (and for connecting to it), milliseconds; on
    /// timeout the blocks are computed instead.
    kvagent_fetch_timeout_ms: u64,
    /// Longest wait for one write-through `PutBlocks` call, milliseconds.
    kvagent_put_timeout_ms: u64,
    /// Most blocks in write-through to kvagent at once; more are dropped (and counted).
    kvagent_put_max_blocks: usize,
    /// Key of the MAC on blocks written to kvagent, 64 hex characters; empty (and no
    /// `kv_mac_key_file`): random per start, so blocks spilled by another run are not reused.
    kv_mac_key: String,
    /// A file holding the MAC key (64 hex characters); empty: none.
    kv_mac_key_file: PathBuf,
    /// A file whose first line is kvagent's engine token (kvagent's `auth.token_file`), sent
    /// as `authorization: Bearer` with every call; empty: none.
    kvagent_token_file: PathBuf,
    /// PEM CA bundle an `https://` kvagent is verified against (for the URL's host).
    kvagent_ca_file: String,
    /// PEM client certificate shown to kvagent (when its `tls.client_ca_file` asks); empty: none.
    kvagent_client_cert_file: String,
    /// Its PEM private key.
    kvagent_client_key_file: String,
    /// KV eviction policy for requests that do not choose one (`kv_eviction.policy`): `none`
    /// (default), `segment`, `h2o` or `streaming` (docs/eviction.md).
    kv_eviction: Policy,
    /// KV slots a sequence keeps once its prompt is computed, for requests that do not choose
    /// (`kv_eviction.budget_tokens`); 0 (default): no budget. Needed by any policy but `none`.
    kv_budget_tokens: usize,
    /// Relevance a segment keeps per assistant turn since its message, in [0, 1] (default 0.5).
    segment_decay: f64,
    /// Log filter.
    log: String,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            served_model_name: "SmolLM2-135M-Instruct".into(),
            max_model_len: 0,
            default_max_tokens: 256,
            prefill_chunk: 256,
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            kv_pool_tokens: 0,
            cache_blocks: 512,
            max_queue: 64,
            max_body_bytes: 4 << 20,
            max_body_buffer_bytes: 64 << 20,
            max_connections: 256,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            threads: 0,
            weights: WeightType::F32,
            kvagent_url: String::new(),
            kvagent_fetch_timeout_ms: 2000,
            kvagent_put_timeout_ms: 10_000,
            kvagent_put_max_blocks: 512,
            kv_mac_key: String::new(),
            kv_mac_key_file: PathBuf::new(),
            kvagent_token_file: PathBuf::new(),
            kvagent_ca_file: String::new(),
            kvagent_client_cert_file: String::new(),
            kvagent_client_key_file: String::new(),
            kv_eviction: Policy::None,
            kv_budget_tokens: 0,
            segment_decay: 0.5,
            log: "info".into(),
        }
    }
}

fn load_config(cli: &Cli) -> anyhow::Result<EngineConfig> {
    let mut cfg = match &cli.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            toml::from_str(&text)
                .with_context(|| format!("{} is not a valid configuration", p.display()))?
        }
        None => EngineConfig::default(),
    };
    if let Some(m) = &cli.model {
        cfg.model = m.clone();
    }
    if let Some(l) = cli.listen {
        cfg.listen = l;
    }
    if let Some(n) = cli.cache_blocks {
        cfg.cache_blocks = n;
    }
    if let Some(n) = cli.prefill_chunk {
        cfg.prefill_chunk = n;
    }
    if let Some(k) = &cli.kvagent {
        cfg.kvagent_url = k.clone();
    }
    if let Some(n) = cli.threads {
        cfg.threads = n;
    }
    if let Some(n) = cli.max_num_seqs {
        cfg.max_num_seqs = n;
    }
    if let Some(n) = cli.max_num_batched_tokens {
        cfg.max_num_batched_tokens = n;
    }
    if let Some(n) = cli.kv_pool_tokens {
        cfg.kv_pool_tokens = n;
    }
    if let Some(p) = &cli.kv_mac_key_file {
        cfg.kv_mac_key_file = p.clone();
    }
    if let Some(p) = &cli.kvagent_token_file {
        cfg.kvagent_token_file = p.clone();
    }
    if let Some(w) = &cli.weights {
        cfg.weights = w
            .parse::<WeightType>()
            .map_err(|e| anyhow::anyhow!("--weights {e}"))?;
    }
    anyhow::ensure!(cfg.prefill_chunk > 0, "prefill_chunk must be > 0");
    anyhow::ensure!(cfg.cache_blocks > 0, "cache_blocks must be > 0");
    anyhow::ensure!(cfg.max_queue > 0, "max_queue must be > 0");
    anyhow::ensure!(cfg.max_num_seqs > 0, "max_num_seqs must be > 0");
    anyhow::ensure!(
        cfg.max_num_batched_tokens > cfg.max_num_seqs,
        "max_num_batched_tokens ({}) must exceed max_num_seqs ({}): a step with every sequence decoding must leave room for prefill",
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs
    );
    anyhow::ensure!(cfg.default_max_tokens > 0, "default_max_tokens must be > 0");
    anyhow::ensure!(
        (0.0..=1.0).contains(&cfg.segment_decay),
        "segment_decay ({}) must be in [0, 1]",
        cfg.segment_decay
    );
    anyhow::ensure!(
        cfg.kv_eviction == Policy::None || cfg.kv_budget_tokens >= cfg.kv_eviction.min_budget(),
        "kv_eviction = {:?} needs kv_budget_tokens of at least {} (it is {})",
        cfg.kv_eviction.as_str(),
        cfg.kv_eviction.min_budget(),
        cfg.kv_budget_tokens
    );
    anyhow::ensure!(
        cfg.kvagent_fetch_timeout_ms > 0 && cfg.kvagent_put_timeout_ms > 0,
        "kvagent_fetch_timeout_ms and kvagent_put_timeout_ms must be > 0"
    );
    anyhow::ensure!(cfg.max_connections > 0, "max_connections must be > 0");
    anyhow::ensure!(
        cfg.header_read_timeout_ms > 0 && cfg.body_read_timeout_ms > 0,
        "header_read_timeout_ms and body_read_timeout_ms must be > 0"
    );
    anyhow::ensure!(
        cfg.max_body_buffer_bytes >= cfg.max_body_bytes,
        "max_body_buffer_bytes ({}) must be at least max_body_bytes ({})",
        cfg.max_body_buffer_bytes,
        cfg.max_body_bytes
    );
    anyhow::ensure!(
        cfg.kv_mac_key.is_empty() || cfg.kv_mac_key_file.as_os_str().is_empty(),
        "set kv_mac_key or kv_mac_key_file, not both"
    );
    Ok(cfg)
}

/// TLS towards kvagent: needed for an `https://` URL, refused for `http://`.
fn kvagent_tls(cfg: &EngineConfig) -> anyhow::Result<Option<kvagent::ClientTls>> {
    let https = cfg
        .kvagent_url
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"));
    anyhow::ensure!(
        https || cfg.kvagent_client_cert_file.is_empty(),
        "kvagent_client_cert_file needs an https:// kvagent_url"
    );
    anyhow::ensure!(
        https != cfg.kvagent_ca_file.is_empty(),
        "kvagent_ca_file goes with an https:// kvagent_url (and an https:// one needs it)"
    );
    anyhow::ensure!(
        cfg.kvagent_client_cert_file.is_empty() == cfg.kvagent_client_key_file.is_empty(),
        "kvagent_client_cert_file and kvagent_client_key_file go together"
    );
    Ok(https.then(|| kvagent::ClientTls {
        ca_file: cfg.kvagent_ca_file.clone(),
        cert_file: cfg.kvagent_client_cert_file.clone(),
        key_file: cfg.kvagent_client_key_file.clone(),
    }))
}

/// kvagent's engine token, from `kvagent_token_file`.
fn kvagent_token(cfg: &EngineConfig) -> anyhow::Result<Option<String>> {
    if cfg.kvagent_token_file.as_os_str().is_empty() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&cfg.kvagent_token_file)
        .with_context(|| format!("kvagent_token_file {}", cfg.kvagent_token_file.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    anyhow::ensure!(
        !token.is_empty(),
        "kvagent_token_file {} is empty",
        cfg.kvagent_token_file.display()
    );
    Ok(Some(token))
}

/// The MAC key of blocks written to kvagent: configured, or random for this run.
fn mac_key(cfg: &EngineConfig) -> anyhow::Result<MacKey> {
    if !cfg.kv_mac_key.is_empty() {
        return MacKey::from_hex(&cfg.kv_mac_key).context("kv_mac_key");
    }
    if !cfg.kv_mac_key_file.as_os_str().is_empty() {
        return Ok(MacKey::from_file(&cfg.kv_mac_key_file)?);
    }
    tracing::info!(
        "no kv_mac_key configured: a random one for this run (blocks spilled by other runs are not reused)"
    );
    Ok(MacKey::random())
}

fn inspect(model: &Path) -> anyhow::Result<()> {
    let g = Gguf::open(model)?;
    println!(
        "architecture {}, {} tensors",
        g.get_str("general.architecture")?,
        g.tensors.len()
    );
    let t = ModelTokenizer::from_gguf(&g).context("building the tokenizer")?;
    let prompt = t.render_chat(&[("user".into(), "What is the capital of France?".into())])?;
    println!(
        "chat prompt ({} tokens): {prompt:?}",
        t.encode(&prompt)?.len()
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line: the context and every cause ("cannot listen on ADDR: Address already in
            // use (os error 98)").
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Restarts this process (same pid, same arguments) with `OMP_WAIT_POLICY=passive` unless the
/// environment already sets a policy; returns only when that failed, with why.
///
/// libgomp (libtorch's OpenMP runtime) reads the policy when it is loaded, before `main`, and
/// by default a thread spins for milliseconds after every parallel region. Measured here, those
/// spinning threads took the cores from candle's Q8_0 kernels (a decode step of 168 ms instead
/// of 33); f32, whose every product is an OpenMP region, measured from no change to 3x slower
/// with the passive policy, so only `q8_0` restarts.
fn passive_openmp() -> Option<std::io::Error> {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("OMP_WAIT_POLICY").is_some() {
        return None;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(e),
    };
    Some(
        std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("OMP_WAIT_POLICY", "passive")
            .exec(),
    )
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Command::Inspect { model }) = &cli.command {
        return inspect(model);
    }
    let cfg = load_config(&cli)?;
    // Before anything starts a thread: exec replaces the whole process.
    if cfg.weights == WeightType::Q8_0 {
        if let Some(e) = passive_openmp() {
            eprintln!("warning: could not restart with OMP_WAIT_POLICY=passive ({e}); set it to keep OpenMP's spinning threads off the cores");
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cfg.log).context("invalid `log` filter")?,
        )
        .with_writer(std::io::stderr)
        // No colour codes in files and container logs.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // The listen socket first: a busy address fails now, before the model is loaded, and
    // nothing announces listening before the bind succeeded.
    let listener = std::net::TcpListener::bind(cfg.listen)
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    listener
        .set_nonblocking(true)
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let threads = if cfg.threads > 0 {
        cfg.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    // The model runs on this (the main) thread: measured, libtorch's OpenMP kernels ran a decode
    // step in 34-38 ms here and in 53-60 ms on a spawned thread. HTTP runs on a small runtime.
    // candle's kernels (`weights = "q8_0"`) size their pool from this when they first run; no
    // other thread exists yet.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    }
    tch::set_num_threads(threads as i32);
    let g = Gguf::open(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?;
    let tokenizer = Arc::new(ModelTokenizer::from_gguf(&g)?);
    let model = Llama::load(&g, cfg.weights)?;
    model
        .check_vocabulary(tokenizer.vocab_size())
        .with_context(|| format!("{} is inconsistent", cfg.model.display()))?;
    let (sampling, warnings) = engine_shim::engine::SamplingDefaults::from_gguf(&g);
    for w in warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(
        temperature = sampling.temperature,
        top_p = sampling.top_p,
        top_k = sampling.top_k,
        min_p = sampling.min_p,
        "default sampling (the model file's hints, else llama.cpp's defaults)"
    );
    // Only where blocks go to kvagent, whose MAC key it binds; hashed from the bytes already
    // loaded rather than read from disk again.
    let fingerprint = (!cfg.kvagent_url.is_empty())
        .then(|| engine_shim::kvstore::weights_fingerprint(g.bytes(), cfg.weights.as_str()));
    drop(g);
    let max_model_len = if cfg.max_model_len == 0 {
        model.cfg.context
    } else {
        cfg.max_model_len.min(model.cfg.context)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let stats = Arc::new(Stats::default());
    let store: Option<Box<dyn BlockStore>> = if cfg.kvagent_url.is_empty() {
        None
    } else {
        let fetch_timeout = Duration::from_millis(cfg.kvagent_fetch_timeout_ms);
        let token = kvagent_token(&cfg)?;
        let tls = kvagent_tls(&cfg)?;
        let mut client = rt
            // The timer is made inside the runtime (it needs its time driver).
            .block_on(async {
                tokio::time::timeout(
                    fetch_timeout,
                    kvagent::connect_with(
                        cfg.kvagent_url.clone(),
                        64 << 20,
                        token.as_deref(),
                        tls.as_ref(),
                    ),
                )
                .await
            })
            .with_context(|| {
                format!(
                    "connecting to kvagent at {}: no answer within {} ms",
                    cfg.kvagent_url, cfg.kvagent_fetch_timeout_ms
                )
            })?
            .with_context(|| format!("connecting to kvagent at {}", cfg.kvagent_url))?;
        // A wrong or missing token would fail every write-through and page-in quietly: check
        // it once now.
        let checked = rt.block_on(async {
            tokio::time::timeout(fetch_timeout, client.stats(kvagent::pb::StatsRequest {})).await
        });
        if let Ok(Err(status)) = checked {
            if matches!(
                status.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            ) {
                anyhow::bail!(
                    "kvagent at {} refused this engine: {} (set kvagent_token_file to kvagent's auth.token_file)",
                    cfg.kvagent_url,
                    status.message()
                );
            }
        }
        Some(Box::new(KvagentStore::new(
            rt.handle().clone(),
            client,
            cfg.served_model_name.clone(),
            mac_key(&cfg)?.for_weights(
                &fingerprint.context("the weights' fingerprint is taken where kvagent is set")?,
            ),
            KvBlock::bytes(&model.cfg),
            Limits {
                fetch_timeout,
                put_timeout: Duration::from_millis(cfg.kvagent_put_timeout_ms),
                put_max_blocks: cfg.kvagent_put_max_blocks,
            },
            stats.clone(),
        )))
    };
    let kv_pool_tokens = if cfg.kv_pool_tokens == 0 {
        4 * max_model_len
    } else {
        anyhow::ensure!(
            cfg.kv_pool_tokens >= max_model_len,
            "kv_pool_tokens ({}) must hold at least one sequence of max_model_len ({max_model_len}) tokens",
            cfg.kv_pool_tokens
        );
        cfg.kv_pool_tokens
    };
    let (jobs, queue) = std::sync::mpsc::sync_channel(cfg.max_queue);
    let schedule = Schedule {
        cache_blocks: cfg.cache_blocks,
        prefill_chunk: cfg.prefill_chunk,
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        kv_pool_tokens,
    };
    tracing::info!(
        weights = cfg.weights.as_str(),
        max_num_seqs = schedule.max_num_seqs,
        max_num_batched_tokens = schedule.max_num_batched_tokens,
        prefill_chunk = schedule.prefill_chunk,
        kv_pool_tokens,
        kv_pool_mib = (kv_pool_tokens * model.cfg.kv_bytes_per_token()) >> 20,
        "continuous batching"
    );
    let worker = Worker::new(
        model,
        tokenizer.clone(),
        &cfg.served_model_name,
        schedule,
        store,
        stats.clone(),
    );
    let app = Arc::new(App {
        model_name: cfg.served_model_name.clone(),
        tokenizer,
        jobs,
        stats,
        max_model_len,
        default_max_tokens: cfg.default_max_tokens,
        sampling,
        max_body_bytes: cfg.max_body_bytes,
        body_read_timeout: Duration::from_millis(cfg.body_read_timeout_ms),
        body_budget: Arc::new(Semaphore::new(
            cfg.max_body_buffer_bytes.min(Semaphore::MAX_PERMITS),
        )),
        tokenizing: Arc::new(Semaphore::new(server::TOKENIZE_CONCURRENCY)),
        max_queue: cfg.max_queue as u64,
        cache_capacity: cfg.cache_blocks,
        kv_pool_tokens,
        kv_epoch: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1),
        eviction: Eviction {
            policy: cfg.kv_eviction,
            budget_tokens: cfg.kv_budget_tokens,
            segments: Vec::new(),
        },
        segment_decay: cfg.segment_decay,
    });
    let listener = {
        let _rt = rt.enter();
        tokio::net::TcpListener::from_std(listener)
            .with_context(|| format!("cannot listen on {addr}"))?
    };
    rt.spawn(serve(
        listener,
        app,
        cfg.max_connections,
        Duration::from_millis(cfg.header_read_timeout_ms),
    ));
    rt.spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        std::process::exit(0);
    });
    println!("engine-shim listening on http://{addr}");
    worker.run(queue);
    Ok(())
}

/// Accepts connections, at most `max_connections` open at once: one more is answered 429 and
/// closed at once (never queued, never spun on). Every connection has a timer, so a head that
/// does not arrive within `header_read_timeout` (also between kept-alive requests) closes it.
async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    max_connections: usize,
    header_read_timeout: Duration,
) {
    let open = Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS)));
    let refusal = over_capacity_response(max_connections);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // EMFILE, ENFILE, ENOBUFS...: the listener stays readable, so retrying at once
                // would spin; wait for descriptors to be released.
                tracing::warn!(error = %e, "accept failed; retrying shortly");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(%peer, max_connections, "over max_connections: refused");
            // Best effort (a fresh socket's send buffer is empty); then closed.
            let _ = stream.try_write(&refusal);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| server::handle(app.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// The raw HTTP answer to a connection over `max_connections`: 429 with an OpenAI error.
fn over_capacity_response(max_connections: usize) -> Vec<u8> {
    let body = ApiError::new(
        ErrorKind::Overloaded,
        format!(
            "engine-shim has {max_connections} connections open (max_connections); retry shortly"
        ),
    )
    .to_json();
    let mut out = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_spells_out_the_defaults() {
        let text = include_str!("../../examples/engine-shim.toml");
        let cfg: EngineConfig = toml::from_str(text).expect("parses");
        assert_eq!(cfg, EngineConfig::default());
        let bad = toml::from_str::<EngineConfig>("prefill_chunks = 3").unwrap_err();
        assert!(bad.to_string().contains("prefill_chunks"));
    }
}
