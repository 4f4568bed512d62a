//! The engine worker: one thread that owns the model and the prefix cache and runs an
//! iteration-level scheduler (continuous batching, Sarathi-Serve's stall-free batching).
//!
//! Each step is one batched forward over every decoding sequence's next token plus at most one
//! chunk of one sequence's prefill, within `max_num_batched_tokens`; sequences join (admission)
//! and leave (finished, failed, or their client gone) between steps. On admission a request's
//! tokenised prompt becomes a token digest chain; its leading blocks found in the prefix cache
//! (or paged in from kvagent) are copied into the sequence's KV and skipped. Once its prompt is
//! computed, its new full blocks are stored (and written through to kvagent), then it decodes,
//! streaming [`Event`]s until EOS, a stop string or `max_tokens`. When the KV pool cannot hold
//! the batch's growth, the newest sequence is preempted: its KV is dropped and it waits at the
//! front of the queue, to be recomputed (its prompt mostly from the prefix cache) when admitted
//! again; what it already streamed is not sent twice.
//!
//! At the end of each step, a sequence whose prompt is computed and that holds more KV than its
//! budget evicts down to it ([`crate::evict`]); its prompt blocks were stored before that, so
//! the prefix cache only ever holds KV computed with nothing evicted.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvmesh_filters::chain::{token_chain, Digest, Namespace};
use tch::{Kind, Tensor};
use tokio::sync::mpsc;

use crate::cache::{KvBlock, PrefixCache, BLOCK_TOKENS};
use crate::evict::{self, Eviction, EvictionReport, Policy};
use crate::model::{Chunk, KvCache, Llama};
use crate::tokenizer::{ModelTokenizer, TextStream};

/// Sampling and stopping.
#[derive(Debug, Clone)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// 0: greedy.
    pub temperature: f64,
    /// Nucleus sampling mass (1: off).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0: off).
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (0: off).
    pub min_p: f64,
    /// RNG seed (random when absent).
    pub seed: Option<u64>,
    /// Generation stops before any of these strings.
    pub stop: Vec<String>,
}

/// Sampling values a request that gives none gets: the model file's own hints
/// (`general.sampling.temp`, `.top_k`, `.top_p`, `.min_p`) where it has them, else
/// llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    /// Temperature.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Min-p (0: off).
    pub min_p: f64,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
            min_p: 0.05,
        }
    }
}

impl SamplingDefaults {
    /// The defaults for a model: its file's hints where present and in range. A hint out of
    /// range is not used, and named in the returned warnings.
    pub fn from_gguf(g: &crate::gguf::Gguf) -> (Self, Vec<String>) {
        let mut d = SamplingDefaults::default();
        let mut warnings = Vec::new();
        let mut float = |key: &str, ok: fn(f64) -> bool, slot: &mut f64| {
            if let Ok(v) = g.get(key) {
                match v.as_f64().filter(|x| ok(*x)) {
                    Some(x) => *slot = x,
                    None => warnings.push(format!("{key} = {v:?} is out of range: not used")),
                }
            }
        };
        float(
            "general.sampling.temp",
            |t| (0.0..=2.0).contains(&t),
            &mut d.temperature,
        );
        float(
            "general.sampling.top_p",
            |t| t > 0.0 && t <= 1.0,
            &mut d.top_p,
        );
        float(
            "general.sampling.min_p",
            |t| (0.0..=1.0).contains(&t),
            &mut d.min_p,
        );
        if let Ok(v) = g.get("general.sampling.top_k") {
            // As llama.cpp: 0 or below is off.
            let k = match v {
                crate::gguf::Value::I64(k) if *k <= 0 => Some(0),
                _ => v.as_u64().and_then(|k| usize::try_from(k).ok()),
            };
            match k {
                Some(k) => d.top_k = k,
                None => warnings.push(format!(
                    "general.sampling.top_k = {v:?} is out of range: not used"
                )),
            }
        }
        (d, warnings)
    }
}

/// What a request gets back, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Prefill is done: prompt tokens and how many came from the cache.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Of those, reused from cached blocks.
        cached_tokens: usize,
    },
    /// New text.
    Text(String),
    /// Finished.
    Done {
        /// `stop` (EOS or a stop string) or `length`.
        finish_reason: &'static str,
        /// Tokens generated.
        completion_tokens: usize,
        /// What KV eviction did to the sequence.
        eviction: EvictionReport,
    },
    /// The engine could not serve this request (it goes on serving the next): the last event.
    Failed {
        /// Why, for the client.
        message: String,
    },
}

/// Why the worker refused a job (the HTTP side checks these first; this is the last line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServeError {
    /// The prompt has no tokens.
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    /// Prompt plus completion exceed the model's context.
    #[error("{prompt} prompt tokens + {max_tokens} completion tokens exceed the model's context of {context}")]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested completion tokens.
        max_tokens: usize,
        /// The model's context length.
        context: usize,
    },
}

/// A queued request.
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sampling.
    pub params: SamplingParams,
    /// Where events go; generation stops when the receiver is dropped.
    pub events: mpsc::UnboundedSender<Event>,
    /// Send text as it is generated (SSE); otherwise once, at the end: every event wakes the
    /// HTTP side, and on a small machine that wake-up preempts libtorch's threads.
    pub stream: bool,
    /// The request's `cache_salt` (empty: none): part of its block digests, so requests with
    /// different salts (tenants) never share cached or paged-in KV blocks.
    pub cache_salt: String,
    /// KV budget and eviction policy (docs/eviction.md).
    pub eviction: Eviction,
}

/// Where evicted and new blocks go, and where missing ones come from (kvagent).
pub trait BlockStore: Send {
    /// Stores blocks (write-through of every new block).
    fn put(&mut self, blocks: Vec<(Digest, Vec<u8>)>);
    /// Fetches blocks in order, stopping at the first missing one.
    fn get_leading(&mut self, digests: &[Digest]) -> Vec<Vec<u8>>;
    /// Whether the store reported, since the last call, that it lost what it held (kvagent
    /// restarted or was cleared): then how many of the blocks still cached here to write
    /// again (the rest of the write-through bound stays for new blocks).
    fn lost(&mut self) -> Option<usize> {
        None
    }
}

/// Live counters the HTTP side reads for `/metrics`.
#[derive(Default)]
pub struct Stats {
    /// Requests waiting: queued, or preempted and waiting to be admitted again.
    pub waiting: AtomicU64,
    /// Sequences in the running batch.
    pub running: AtomicU64,
    /// Blocks in the prefix cache.
    pub cache_blocks: AtomicU64,
    /// Prompt tokens seen.
    pub prompt_tokens: AtomicU64,
    /// Of those, reused from the cache (local or paged in).
    pub cached_tokens: AtomicU64,
    /// Of those, paged in from kvagent.
    pub paged_in_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Requests that failed inside the engine (answered 500; the engine went on).
    pub requests_failed: AtomicU64,
    /// Blocks from kvagent not used on page-in, by [`crate::kvstore::RejectReason::index`].
    pub pagein_rejected: [AtomicU64; 5],
    /// Page-ins from kvagent that timed out (treated as misses).
    pub pagein_timeouts: AtomicU64,
    /// Page-ins not asked for, because one timed out within the last
    /// [`crate::kvstore::PAGEIN_PAUSE`] (treated as misses).
    pub pagein_skipped: AtomicU64,
    /// Page-ins from kvagent that failed (treated as misses).
    pub pagein_errors: AtomicU64,
    /// Blocks whose write-through to kvagent was dropped: too many were in flight.
    pub writethrough_dropped_blocks: AtomicU64,
    /// Write-through `PutBlocks` calls that failed or timed out.
    pub writethrough_failed: AtomicU64,
    /// Times kvagent was found to have lost its blocks (a new `kv_epoch`) and the cached
    /// blocks were written through again.
    pub writethrough_resyncs: AtomicU64,
    /// Sequences preempted (their KV dropped, recomputed when admitted again).
    pub preemptions: AtomicU64,
    /// Tokens of KV the running sequences hold (their buffers' capacity).
    pub kv_pool_used_tokens: AtomicU64,
    /// The most `kv_pool_used_tokens` ever was (its high-water mark since the engine started).
    pub kv_pool_peak_tokens: AtomicU64,
    /// KV evictions, by [`Policy::index`].
    pub kv_evictions: [AtomicU64; 4],
    /// Tokens of KV evicted, by [`Policy::index`].
    pub kv_evicted_tokens: [AtomicU64; 4],
    /// Sequences that finished holding more KV than their budget (reserved tokens the segment
    /// policy may not drop), by [`Policy::index`].
    pub kv_over_budget_sequences: [AtomicU64; 4],
    /// Requests whose `x-kvmesh-prefix-digests` were checked against this engine's own chain,
    /// by [`kvmesh_filters::chain::DigestCheck::index`].
    pub routing_digests: [AtomicU64; 3],
    /// Per-step distributions.
    pub steps: StepMetrics,
}

/// Distributions over the scheduler's steps (one batched forward each).
pub struct StepMetrics {
    /// Sequences per step.
    pub batch_size: prometheus::Histogram,
    /// Tokens per step (decode tokens plus the prefill chunk): vLLM's `iteration_tokens_total`.
    pub tokens: prometheus::Histogram,
    /// Seconds per step (forward and sampling).
    pub seconds: prometheus::Histogram,
}

impl Default for StepMetrics {
    fn default() -> Self {
        let h = |name: &str, help: &str, buckets: Vec<f64>| {
            prometheus::Histogram::with_opts(
                prometheus::HistogramOpts::new(name, help).buckets(buckets),
            )
            .unwrap_or_else(|e| panic!("histogram {name}: {e}"))
        };
        StepMetrics {
            batch_size: h(
                "engine_shim_batch_size",
                "Sequences per engine step.",
                vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
            ),
            tokens: h(
                "vllm:iteration_tokens_total",
                "Tokens per engine step.",
                vec![
                    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                ],
            ),
            seconds: h(
                "engine_shim_step_seconds",
                "Seconds per engine step.",
                vec![0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56],
            ),
        }
    }
}

/// How the scheduler batches (docs/engine-shim.md, "Scheduling").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Prefix cache capacity, in blocks.
    pub cache_blocks: usize,
    /// Most prompt tokens of one sequence computed in one step.
    pub prefill_chunk: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens in one step: every decoding sequence's one, plus at most one prefill chunk
    /// in what is left.
    pub max_num_batched_tokens: usize,
    /// Most tokens of KV the running sequences hold together; a sequence that cannot grow
    /// preempts the newest one.
    pub kv_pool_tokens: usize,
}

/// Tokens of KV room a sequence is admitted with beyond its prompt (then it grows by half
/// again, at least this much, each time it runs out).
const KV_GROWTH: usize = 64;

/// One request in the scheduler.
struct Seq {
    job: Job,
    /// Prompt, then every generated token (the last one not yet computed while decoding).
    tokens: Vec<u32>,
    /// The prompt's token digest chain.
    chain: Vec<Digest>,
    /// `None` while waiting (new or preempted).
    kv: Option<KvCache>,
    /// Tokens generated (EOS not counted).
    generated: usize,
    /// Their text so far, a piece at a time.
    detok: TextStream,
    /// Their text: every piece `detok` gave.
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
    rng: fastrand::Rng,
    /// Prompt tokens reused from the cache at first admission (`None`: not admitted yet).
    cached: Option<usize>,
    /// Whether the prompt's blocks are in the prefix cache and `Started` was sent.
    prefilled: bool,
    /// Blocks this request added to the pool (paged in or computed): dropped from it if the
    /// request fails. Blocks it only read stay: they were copied into its own KV buffer, never
    /// written, and other requests' prefixes depend on them.
    created: Vec<Digest>,
    started: std::time::Instant,
    /// What eviction did so far.
    evicted: EvictionReport,
}

impl Seq {
    /// Tokens computed (the position of the next one).
    fn computed(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.pos)
    }

    /// KV slots held (fewer than [`Seq::computed`] once anything was evicted).
    fn held(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.len)
    }

    fn capacity(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.capacity)
    }

    /// Tokens the sequence can ever hold (its prompt and `max_tokens`).
    fn max_len(&self) -> usize {
        self.job.prompt.len() + self.job.params.max_tokens
    }

    /// Whether more than one token is left to compute (prefill, or recompute after a
    /// preemption).
    fn prefilling(&self) -> bool {
        self.tokens.len() - self.computed() > 1
    }

    /// Whether its KV buffer grows with prefill instead of being reserved whole at admission:
    /// it has a budget to shrink to once its prompt is computed.
    fn grows_with_prefill(&self) -> bool {
        self.job.eviction.active() && self.prefilling()
    }

    /// KV room a sequence needs at admission: its prompt (or what it computes again) plus some
    /// growth.
    fn admission_room(&self) -> usize {
        (self.tokens.len() + KV_GROWTH).min(self.max_len())
    }

    /// Tokens of the pool the sequence is counted at for admitting others: what it holds, or,
    /// while it grows with prefill, the room it was admitted with (it will hold that much).
    fn committed(&self) -> usize {
        if self.grows_with_prefill() {
            self.capacity().max(self.admission_room())
        } else {
            self.capacity()
        }
    }
}

/// What a step does with one running sequence.
enum Outcome {
    /// Still running.
    Continue,
    /// Finished (or failed); its last events.
    Finish(Vec<Event>),
    /// The client left.
    Gone,
}

/// The worker's state: the model, the prefix cache, and the scheduler's queues.
pub struct Worker {
    model: Llama,
    tokenizer: Arc<ModelTokenizer>,
    cache: PrefixCache,
    /// The unsalted namespace, and the model name salted ones are derived from.
    ns: Namespace,
    model_name: String,
    schedule: Schedule,
    store: Option<Box<dyn BlockStore>>,
    stats: Arc<Stats>,
    /// Admitted, in admission order (the newest last: the first to be preempted).
    running: Vec<Seq>,
    /// Not admitted yet, in order (preempted sequences go back to the front).
    waiting: VecDeque<Seq>,
}

impl Worker {
    /// A worker over a loaded model. The schedule's bounds are clamped to sane minimums: a
    /// prefill chunk of at least 1, one sequence, a step budget above `max_num_seqs` (so that
    /// prefill always progresses). A sequence alone in the batch runs even if it outgrows
    /// `kv_pool_tokens` (the binary refuses a pool smaller than `max_model_len`).
    pub fn new(
        model: Llama,
        tokenizer: Arc<ModelTokenizer>,
        model_name: &str,
        schedule: Schedule,
        store: Option<Box<dyn BlockStore>>,
        stats: Arc<Stats>,
    ) -> Self {
        let mut schedule = schedule;
        schedule.prefill_chunk = schedule.prefill_chunk.max(1);
        schedule.max_num_seqs = schedule.max_num_seqs.max(1);
        schedule.max_num_batched_tokens = schedule
            .max_num_batched_tokens
            .max(schedule.max_num_seqs + 1);
        Worker {
            cache: PrefixCache::new(schedule.cache_blocks),
            model,
            tokenizer,
            ns: Namespace::new(model_name, b""),
            model_name: model_name.to_string(),
            schedule,
            store,
            stats,
            running: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Serves jobs until the queue closes and every admitted one is done: each turn takes the
    /// new jobs, drops those whose client left, admits what the batch and the KV pool allow,
    /// and runs one step.
    pub fn run(mut self, jobs: std::sync::mpsc::Receiver<Job>) {
        let _no_grad = tch::no_grad_guard();
        let mut open = true;
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match jobs.recv() {
                    Ok(job) => self.enqueue(job),
                    Err(_) => return,
                }
            }
            while open {
                match jobs.try_recv() {
                    Ok(job) => self.enqueue(job),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            self.drop_departed();
            self.admit();
            if !self.running.is_empty() {
                self.step();
            } else if !open && self.waiting.is_empty() {
                return;
            }
        }
    }

    /// A new job joins the waiting queue, or is answered at once when it cannot run.
    fn enqueue(&mut self, job: Job) {
        let context = self.model.cfg.context;
        let refusal = if job.prompt.is_empty() {
            Some(ServeError::EmptyPrompt)
        } else if job
            .prompt
            .len()
            .checked_add(job.params.max_tokens)
            .is_none_or(|n| n > context)
        {
            Some(ServeError::TooLong {
                prompt: job.prompt.len(),
                max_tokens: job.params.max_tokens,
                context,
            })
        } else {
            None
        };
        if job.events.is_closed() || refusal.is_some() {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(e) = refusal {
            self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Failed {
                message: e.to_string(),
            });
            return;
        }
        if job.events.is_closed() {
            return;
        }
        let chain = if job.cache_salt.is_empty() {
            token_chain(&self.ns, &job.prompt, BLOCK_TOKENS)
        } else {
            token_chain(
                &Namespace::new(&self.model_name, job.cache_salt.as_bytes()),
                &job.prompt,
                BLOCK_TOKENS,
            )
        };
        let seed = job.params.seed.unwrap_or_else(|| fastrand::u64(..));
        self.waiting.push_back(Seq {
            tokens: job.prompt.clone(),
            chain,
            kv: None,
            generated: 0,
            detok: TextStream::default(),
            text: String::new(),
            sent: 0,
            rng: fastrand::Rng::with_seed(seed),
            cached: None,
            prefilled: false,
            created: Vec::new(),
            started: std::time::Instant::now(),
            evicted: EvictionReport::default(),
            job,
        });
    }

    /// Sequences whose client left are dropped, freeing their KV.
    fn drop_departed(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.job.events.is_closed());
        let gone = (before - self.waiting.len()) as u64;
        self.stats.waiting.fetch_sub(gone, Ordering::Relaxed);
        self.running.retain(|s| !s.job.events.is_closed());
        self.publish_gauges();
    }

    fn pool_used(&self) -> usize {
        self.running.iter().map(Seq::capacity).sum()
    }

    fn publish_gauges(&self) {
        self.stats
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        let used = self.pool_used() as u64;
        self.stats
            .kv_pool_used_tokens
            .store(used, Ordering::Relaxed);
        self.stats
            .kv_pool_peak_tokens
            .fetch_max(used, Ordering::Relaxed);
        self.stats
            .cache_blocks
            .store(self.cache.len() as u64, Ordering::Relaxed);
    }

    /// Admits waiting sequences in order while the batch has room and the KV pool can hold
    /// their prompt: each gets its KV buffer, with the leading blocks found in the prefix cache
    /// (or paged in from the store) copied in.
    fn admit(&mut self) {
        while self.running.len() < self.schedule.max_num_seqs {
            let Some(front) = self.waiting.front() else {
                return;
            };
            let room = front.admission_room();
            let committed: usize = self.running.iter().map(Seq::committed).sum();
            if !self.running.is_empty() && committed + room > self.schedule.kv_pool_tokens {
                return;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                return;
            };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            let h2o = seq.job.eviction.active() && seq.job.eviction.policy == Policy::H2o;
            // H2O ranks slots by the attention they received since they were written: a block
            // copied from the cache would come without its own prompt's share of it.
            let blocks = if h2o { 0 } else { self.cached_prefix(&mut seq) };
            let cached = blocks * BLOCK_TOKENS;
            // A sequence at a KV budget holds its whole prompt only at the end of prefill, and
            // its budget after that: its buffer grows chunk by chunk (make_room) instead of being
            // reserved whole here, so the pool counts what it holds. It is admitted, and counted
            // for admitting others until its prompt is computed, at its whole prompt, which it
            // holds for one step.
            let capacity = if seq.grows_with_prefill() {
                (cached + KV_GROWTH).min(room)
            } else {
                room
            };
            let mut kv = KvCache::new(&self.model.cfg, capacity);
            if h2o {
                kv.track_attention(&self.model.cfg);
            }
            self.cache.load(&seq.chain, blocks, &mut kv);
            seq.kv = Some(kv);
            if seq.cached.is_none() {
                seq.cached = Some(cached);
                self.stats
                    .prompt_tokens
                    .fetch_add(seq.job.prompt.len() as u64, Ordering::Relaxed);
                self.stats
                    .cached_tokens
                    .fetch_add(cached as u64, Ordering::Relaxed);
            }
            self.running.push(seq);
        }
        self.publish_gauges();
    }

    /// How many of the sequence's leading blocks the prefix cache holds, after paging missing
    /// ones in from the store. At least one token is always left to compute: its logits start
    /// (or resume) the answer.
    fn cached_prefix(&mut self, seq: &mut Seq) -> usize {
        let usable = ((seq.tokens.len() - 1) / BLOCK_TOKENS).min(seq.chain.len());
        let chain = &seq.chain[..usable];
        let mut local = self.cache.leading(chain);
        if let Some(store) = self.store.as_mut() {
            let want = &chain[local..];
            if !want.is_empty() {
                let got = store.get_leading(want);
                let mut paged = 0;
                for (d, bytes) in want.iter().zip(got) {
                    match KvBlock::from_bytes(&self.model.cfg, &bytes) {
                        Some(b) => {
                            self.cache.insert(*d, b);
                            seq.created.push(*d);
                            paged += 1;
                        }
                        None => break,
                    }
                }
                self.stats
                    .paged_in_tokens
                    .fetch_add((paged * BLOCK_TOKENS) as u64, Ordering::Relaxed);
                local = self.cache.leading(chain);
            }
        }
        local
    }

    /// The step's plan: tokens to compute per running sequence (0: none this step). Every
    /// decoding sequence computes its one token; the oldest sequence still in prefill gets one
    /// chunk of what is left of the budget.
    fn plan(&self) -> Vec<usize> {
        let mut plan: Vec<usize> = self
            .running
            .iter()
            .map(|s| usize::from(s.tokens.len() - s.computed() == 1))
            .collect();
        let left = self
            .schedule
            .max_num_batched_tokens
            .saturating_sub(plan.iter().sum());
        if let Some((i, s)) = self
            .running
            .iter()
            .enumerate()
            .find(|(_, s)| s.prefilling())
        {
            plan[i] = (s.tokens.len() - s.computed())
                .min(self.schedule.prefill_chunk)
                .min(left);
        }
        plan
    }

    /// Extra KV room each planned sequence needs at least.
    fn growth_needed(&self, plan: &[usize]) -> usize {
        self.running
            .iter()
            .zip(plan)
            .map(|(s, &n)| (s.held() + n).saturating_sub(s.capacity()))
            .sum()
    }

    /// Makes room for the plan: preempts the newest sequences (their KV dropped, recomputed
    /// when admitted again) until every planned one can grow, then grows them, by half again
    /// where the pool allows. Returns the plan that fits.
    fn make_room(&mut self) -> Vec<usize> {
        let mut plan = self.plan();
        while self.running.len() > 1
            && self.pool_used() + self.growth_needed(&plan) > self.schedule.kv_pool_tokens
        {
            if let Some(mut victim) = self.running.pop() {
                tracing::debug!(
                    computed = victim.computed(),
                    "KV pool full: preempting the newest sequence (recomputed when admitted again)"
                );
                victim.kv = None;
                self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
                self.stats.waiting.fetch_add(1, Ordering::Relaxed);
                self.waiting.push_front(victim);
            }
            plan = self.plan();
        }
        let mut used = self.pool_used();
        let mut still_needed = self.growth_needed(&plan);
        let pool = self.schedule.kv_pool_tokens;
        let cfg = &self.model.cfg;
        for (s, &n) in self.running.iter_mut().zip(&plan) {
            let (cap, need) = (s.capacity(), s.held() + n);
            if need <= cap {
                continue;
            }
            still_needed -= need - cap;
            // Growing with prefill: no further than what is left to compute.
            let most = if s.grows_with_prefill() {
                s.tokens.len()
            } else {
                s.max_len()
            };
            let roomy = need.max(cap + KV_GROWTH.max(cap / 2)).min(most);
            let target = if used + (roomy - cap) + still_needed <= pool {
                roomy
            } else {
                need
            };
            if let Some(kv) = s.kv.as_mut() {
                kv.reserve(cfg, target);
            }
            used += target - cap;
        }
        plan
    }

    /// One iteration: a batched forward over the plan, then sampling for every sequence whose
    /// computed tokens reached its end.
    fn step(&mut self) {
        let t0 = std::time::Instant::now();
        let plan = self.make_room();
        // The pool's high-water mark is reached here, before eviction shrinks anything.
        self.publish_gauges();
        let (logits, failed) = self.forward(&plan);
        let greedy: Vec<i64> = match &logits {
            Some(l) if l.size()[0] > 0 => Vec::try_from(l.argmax(-1, false)).unwrap_or_default(),
            _ => Vec::new(),
        };
        let mut row = 0usize;
        let mut outcomes = Vec::with_capacity(self.running.len());
        for (i, &n) in plan.iter().enumerate() {
            if failed.contains(&i) {
                outcomes.push(Outcome::Finish(vec![self.fail(i)]));
                continue;
            }
            if n == 0 {
                outcomes.push(Outcome::Continue);
                continue;
            }
            let wants = self.running[i].computed() == self.running[i].tokens.len();
            if !wants {
                outcomes.push(Outcome::Continue);
                continue;
            }
            let this = row;
            row += 1;
            if !self.running[i].prefilled {
                self.store_prompt_blocks(i);
            }
            let next = match (&logits, greedy.get(this)) {
                (Some(_), Some(&g)) if self.running[i].job.params.temperature < MIN_TEMPERATURE => {
                    g as u32
                }
                (Some(l), _) => {
                    let s = &mut self.running[i];
                    sample(&l.get(this as i64), &s.job.params, &mut s.rng)
                }
                (None, _) => self.tokenizer.eos,
            };
            outcomes.push(self.advance(i, next));
        }
        // Finished sequences leave the batch (and the gauges change) before their last events
        // are sent: a client that reads /metrics right after its answer sees it finished.
        let mut last_events = Vec::new();
        let mut kept = Vec::with_capacity(self.running.len());
        for (seq, outcome) in std::mem::take(&mut self.running).into_iter().zip(outcomes) {
            match outcome {
                Outcome::Continue => kept.push(seq),
                Outcome::Finish(events) => last_events.push((seq, events)),
                Outcome::Gone => {}
            }
        }
        self.running = kept;
        self.evict_over_budget();
        self.publish_gauges();
        for (seq, events) in last_events {
            for ev in events {
                let _ = seq.job.events.send(ev);
            }
        }
        let tokens: usize = plan.iter().sum();
        self.stats.steps.tokens.observe(tokens as f64);
        self.stats
            .steps
            .batch_size
            .observe(plan.iter().filter(|&&n| n > 0).count() as f64);
        self.stats.steps.seconds.observe(t0.elapsed().as_secs_f64());
    }

    /// The batched forward over `plan`: the logits of every chunk that reached its sequence's
    /// end, in order, and the sequences that failed. When the batch fails (libtorch raised),
    /// each sequence is run again alone, so only the one that cannot be computed fails.
    fn forward(&mut self, plan: &[usize]) -> (Option<Tensor>, Vec<usize>) {
        let model = &self.model;
        let mut chunks = Vec::new();
        let mut who = Vec::new();
        for (i, (s, &n)) in self.running.iter_mut().zip(plan).enumerate() {
            if n == 0 {
                continue;
            }
            let Some(kv) = s.kv.as_mut() else { continue };
            let from = kv.pos;
            let wants = from + n == s.tokens.len();
            chunks.push(Chunk {
                tokens: &s.tokens[from..from + n],
                kv,
                logits: wants,
                // One token past the prompt: a decode step. A preempted sequence recomputes what
                // it generated with its prompt, as prompt rows, but for a lone last token.
                decode: n == 1 && from >= s.job.prompt.len(),
            });
            who.push(i);
        }
        match catch_unwind(AssertUnwindSafe(|| model.forward_batch(&mut chunks))) {
            Ok(l) => return (Some(l), Vec::new()),
            Err(panic) if chunks.len() == 1 => {
                tracing::error!(error = %panic_text(&panic), "a sequence failed in the engine; serving the others");
                return (None, who);
            }
            Err(panic) => {
                tracing::warn!(error = %panic_text(&panic), batch = chunks.len(), "a batched step failed: running its sequences one at a time");
            }
        }
        let mut rows = Vec::new();
        let mut failed = Vec::new();
        for (chunk, &i) in chunks.iter_mut().zip(&who) {
            let one = std::slice::from_mut(chunk);
            match catch_unwind(AssertUnwindSafe(|| model.forward_batch(one))) {
                Ok(l) => rows.push(l),
                Err(panic) => {
                    tracing::error!(error = %panic_text(&panic), "a sequence failed in the engine; serving the others");
                    failed.push(i);
                }
            }
        }
        let logits = (!rows.is_empty()).then(|| Tensor::cat(&rows, 0));
        (logits, failed)
    }

    /// The sequence's answer to a failure; the blocks it added leave the pool.
    fn fail(&mut self, i: usize) -> Event {
        self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
        let created = std::mem::take(&mut self.running[i].created);
        for d in &created {
            self.cache.remove(d);
        }
        Event::Failed {
            message: "the engine failed while serving this request".into(),
        }
    }

    /// The prompt is computed: its new full blocks join the pool (and kvagent), and the client
    /// is told how much of it was cached.
    fn store_prompt_blocks(&mut self, i: usize) {
        let mut fresh = Vec::new();
        {
            let s = &mut self.running[i];
            s.prefilled = true;
            if let Some(kv) = s.kv.as_ref() {
                for (b, d) in s.chain.iter().enumerate() {
                    if (b + 1) * BLOCK_TOKENS > kv.pos {
                        break;
                    }
                    if !self.cache.contains(d) {
                        // Stored before any eviction: slot i still holds position i.
                        debug_assert_eq!(kv.len, kv.pos);
                        let block = KvBlock::from_sequence(kv, b);
                        if self.store.is_some() {
                            fresh.push((*d, block.to_bytes()));
                        }
                        self.cache.insert(*d, block);
                        s.created.push(*d);
                    }
                }
            }
            let _ = s.job.events.send(Event::Started {
                prompt_tokens: s.job.prompt.len(),
                cached_tokens: s.cached.unwrap_or(0),
            });
            tracing::debug!(
                prompt = s.job.prompt.len(),
                cached = s.cached.unwrap_or(0),
                prefill_ms = s.started.elapsed().as_secs_f64() * 1e3,
                "prefill done"
            );
        }
        if let (Some(store), false) = (self.store.as_mut(), fresh.is_empty()) {
            store.put(fresh);
        }
        // After this request's own new blocks, which must not lose their place to it.
        self.resync_if_lost();
    }

    /// Takes the sampled token `next` into sequence `i`: streams new text, and says whether it
    /// goes on.
    fn advance(&mut self, i: usize, next: u32) -> Outcome {
        let eos = self.tokenizer.eos;
        let s = &mut self.running[i];
        let p = &s.job.params;
        let mut finish = None;
        let before = s.text.len();
        // Text the stream holds back for an incomplete UTF-8 sequence, with U+FFFD for it: a
        // stop string may end in it (" \xe2\x80" completes ": ").
        let mut held = String::new();
        if next == eos {
            finish = Some("stop");
        } else {
            s.generated += 1;
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            match self.tokenizer.decode_step(&mut s.detok, next) {
                Ok(Some(piece)) => s.text.push_str(&piece),
                Ok(None) => held = self.tokenizer.decode_rest(&s.detok).unwrap_or_default(),
                Err(e) => tracing::warn!(token = next, "detokenising: {e}"),
            }
        }
        let text = &s.text;
        // A stop string before `before` would have ended the request when it came.
        if finish.is_none() && p.stop.iter().any(|st| ends_after(text, &held, before, st)) {
            finish = Some("stop");
        }
        if finish.is_none() {
            // Hold back an incomplete UTF-8 sequence, and text that may begin a stop string.
            let hold = p
                .stop
                .iter()
                .map(|st| longest_suffix_prefix(text, st))
                .max()
                .unwrap_or(0);
            let mut upto = text.len() - hold;
            while upto > s.sent && !text.is_char_boundary(upto) {
                upto -= 1;
            }
            if s.job.stream && !text[..upto].ends_with('\u{FFFD}') && upto > s.sent {
                if s.job
                    .events
                    .send(Event::Text(text[s.sent..upto].to_string()))
                    .is_err()
                {
                    return Outcome::Gone;
                }
                s.sent = upto;
            }
            if s.generated >= p.max_tokens {
                finish = Some("length");
            }
        }
        let Some(finish_reason) = finish else {
            s.tokens.push(next);
            return Outcome::Continue;
        };
        // Text held back for an incomplete UTF-8 sequence ends the answer as U+FFFD.
        match self.tokenizer.decode_rest(&s.detok) {
            Ok(rest) => s.text.push_str(&rest),
            Err(e) => tracing::warn!("detokenising: {e}"),
        }
        let text = &s.text;
        let text = match p.stop.iter().filter_map(|st| text.find(st.as_str())).min() {
            Some(cut) => &text[..cut],
            None => &text[..],
        };
        let mut last = Vec::with_capacity(2);
        if text.len() > s.sent {
            last.push(Event::Text(text[s.sent..].to_string()));
        }
        tracing::debug!(
            prompt = s.job.prompt.len(),
            generated = s.generated,
            ms = s.started.elapsed().as_secs_f64() * 1e3,
            "request done"
        );
        if s.evicted.over_budget_tokens > 0 {
            let policy = s.job.eviction.policy.index();
            self.stats.kv_over_budget_sequences[policy].fetch_add(1, Ordering::Relaxed);
        }
        last.push(Event::Done {
            finish_reason,
            completion_tokens: s.generated,
            eviction: s.evicted,
        });
        Outcome::Finish(last)
    }

    /// The eviction boundary (`crate::evict`): every sequence whose prompt is computed and that
    /// holds more KV than its budget evicts down to it. Its buffer shrinks to what is kept plus
    /// room for the tokens it may still generate (at most [`KV_GROWTH`]).
    fn evict_over_budget(&mut self) {
        let cfg = &self.model.cfg;
        let mut failed = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            let ev = &s.job.eviction;
            let decoding = s.prefilled && s.computed() + 1 == s.tokens.len();
            if !decoding || !ev.active() || s.held() <= ev.budget_tokens {
                continue;
            }
            let max_len = s.max_len();
            let Some(kv) = s.kv.as_mut() else { continue };
            let headroom = max_len.saturating_sub(kv.pos).min(KV_GROWTH);
            // libtorch raising here (say, an allocation) must fail this sequence, not the engine.
            let dropped = match catch_unwind(AssertUnwindSafe(|| {
                evict::evict(cfg, kv, ev, headroom)
            })) {
                Ok(n) => n,
                Err(panic) => {
                    tracing::error!(error = %panic_text(&panic), "KV eviction failed; failing that sequence");
                    failed.push(i);
                    continue;
                }
            };
            let p = ev.policy.index();
            if dropped > 0 {
                s.evicted.evictions += 1;
                s.evicted.evicted_tokens += dropped;
                self.stats.kv_evictions[p].fetch_add(1, Ordering::Relaxed);
                self.stats.kv_evicted_tokens[p].fetch_add(dropped as u64, Ordering::Relaxed);
                tracing::debug!(
                    policy = ev.policy.as_str(),
                    dropped,
                    kept = kv.len,
                    position = kv.pos,
                    "KV evicted"
                );
            }
            s.evicted.over_budget_tokens = s
                .evicted
                .over_budget_tokens
                .max(kv.len.saturating_sub(ev.budget_tokens));
        }
        for &i in failed.iter().rev() {
            let event = self.fail(i);
            let seq = self.running.remove(i);
            let _ = seq.job.events.send(event);
        }
    }

    /// kvagent lost its blocks (restarted, or cleared): the blocks cached here, most recently
    /// used first and as many as the store allows, are written through again, in batches, so
    /// that other engines can page whole chains in again (without it, the leading blocks every
    /// prompt shares, such as the chat template's system prompt, would stay missing there for
    /// as long as they stay cached here).
    fn resync_if_lost(&mut self) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        let Some(budget) = store.lost() else {
            return;
        };
        self.stats
            .writethrough_resyncs
            .fetch_add(1, Ordering::Relaxed);
        let digests = self.cache.most_recent(budget);
        tracing::info!(
            blocks = digests.len(),
            "kvagent lost its blocks (new kv_epoch): writing the cached ones again"
        );
        for batch in digests.chunks(RESYNC_BATCH) {
            let blocks = batch
                .iter()
                .filter_map(|d| self.cache.peek(d).map(|b| (*d, b.to_bytes())))
                .collect();
            store.put(blocks);
        }
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Whether `stop` occurs in `text` followed by `held`, ending after byte `old`: only such a
/// match can be new since `text` was `old` bytes long, so the text is searched once, not
/// after every token.
fn ends_after(text: &str, held: &str, old: usize, stop: &str) -> bool {
    let mut from = old.saturating_sub(stop.len().saturating_sub(1));
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    if held.is_empty() {
        text[from..].contains(stop)
    } else {
        [&text[from..], held].concat().contains(stop)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Blocks per write-through call when the cache is written again ([`Worker::resync_if_lost`]).
const RESYNC_BATCH: usize = 16;

/// Temperatures below this are greedy: dividing logits by less overflows f32 (vLLM's
/// `_SAMPLING_EPS`).
const MIN_TEMPERATURE: f64 = 1e-5;

/// Greedy at temperature 0 (or below [`MIN_TEMPERATURE`]); otherwise the temperature-scaled
/// distribution truncated by `min_p`, then `top_k`, then `top_p` over what is left (vLLM v1's
/// order), and sampled.
fn sample(logits: &Tensor, p: &SamplingParams, rng: &mut fastrand::Rng) -> u32 {
    let row = logits.flatten(0, -1);
    if p.temperature < MIN_TEMPERATURE {
        return row.argmax(-1, false).int64_value(&[]) as u32;
    }
    let probs: Vec<f32> =
        Vec::try_from((&row / p.temperature).softmax(-1, Kind::Float)).unwrap_or_default();
    match pick(&probs, p, rng.f64()) {
        Some(i) => i as u32,
        None => row.argmax(-1, false).int64_value(&[]) as u32,
    }
}

/// The token `r` (uniform in [0, 1)) picks from `probs` once truncated by `p`'s `min_p`,
/// `top_k` and `top_p` (each over what the previous left, renormalised); `None` for an
/// empty or non-finite distribution (the caller then takes the argmax).
fn pick(probs: &[f32], p: &SamplingParams, r: f64) -> Option<usize> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let first = *order.first()?;
    if !probs[first].is_finite() || probs[first] <= 0.0 {
        return None;
    }
    // min_p is relative to the most likely token: renormalising does not move it.
    let floor = p.min_p * probs[first] as f64;
    order.retain(|&i| probs[i] as f64 >= floor);
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let kept: f64 = order.iter().map(|&i| probs[i] as f64).sum();
    let mut mass = 0.0f64;
    let mut keep = 0;
    for &i in &order {
        mass += probs[i] as f64;
        keep += 1;
        if mass >= p.top_p * kept {
            break;
        }
    }
    order.truncate(keep.max(1));
    let mass: f64 = order.iter().map(|&i| probs[i] as f64).sum();
    let mut left = r * mass;
    for &i in &order {
        left -= probs[i] as f64;
        if left <= 0.0 {
            return Some(i);
        }
    }
    Some(first)
}

#[cfg(test)]
mod tests {
    use super::{ends_after, longest_suffix_prefix, pick, SamplingParams};

    fn params(top_k: usize, top_p: f64, min_p: f64) -> SamplingParams {
        SamplingParams {
            max_tokens: 1,
            temperature: 1.0,
            top_p,
            top_k,
            min_p,
            seed: None,
            stop: Vec::new(),
        }
    }

    #[test]
    fn truncation_keeps_exactly_what_each_knob_allows() {
        let probs = [0.05f32, 0.5, 0.2, 0.15, 0.1];
        // Picks over r in [0, 1) reach every kept token and no other.
        let reach = |p: &SamplingParams| {
            let mut seen: Vec<usize> = (0..1000)
                .filter_map(|i| pick(&probs, p, i as f64 / 1000.0))
                .collect();
            seen.sort_unstable();
            seen.dedup();
            seen
        };
        assert_eq!(reach(&params(0, 1.0, 0.0)), vec![0, 1, 2, 3, 4]);
        assert_eq!(reach(&params(1, 1.0, 0.0)), vec![1], "top_k = 1 is greedy");
        assert_eq!(reach(&params(2, 1.0, 0.0)), vec![1, 2]);
        // 0.5 misses top_p = 0.65, 0.5 + 0.2 reaches it: the two most likely.
        assert_eq!(reach(&params(0, 0.65, 0.0)), vec![1, 2]);
        // top_p over what top_k kept, renormalised: of 0.5 + 0.2 + 0.15 = 0.85, 0.6 of it is
        // 0.51, which 0.5 alone misses and 0.5 + 0.2 reaches.
        assert_eq!(reach(&params(3, 0.6, 0.0)), vec![1, 2]);
        // min_p 0.25: at least 0.125, so 0.1 and 0.05 go.
        assert_eq!(reach(&params(0, 1.0, 0.25)), vec![1, 2, 3]);
        assert_eq!(reach(&params(0, 1.0, 1.0)), vec![1], "min_p = 1 is greedy");
        assert_eq!(pick(&[], &params(0, 1.0, 0.0), 0.5), None);
        // Overflowed logits: no pick (the caller takes the argmax), never an arbitrary token.
        assert_eq!(pick(&[f32::NAN, f32::NAN], &params(0, 1.0, 0.0), 0.5), None);
        assert_eq!(reach(&params(0, 1.0, 0.0)).len(), 5);
    }

    #[test]
    fn stop_string_holdback() {
        assert_eq!(longest_suffix_prefix("Hello Wo", "World"), 2);
        assert_eq!(longest_suffix_prefix("Hello", "World"), 0);
        assert_eq!(
            longest_suffix_prefix("abc", "c"),
            0,
            "a full match is found, not held"
        );
    }

    #[test]
    fn a_stop_string_is_found_once_it_ends_in_new_text() {
        // "World" ends in the new "ld".
        assert!(ends_after("Hello World", "", 9, "World"));
        // Wholly before the new text: found when it came, not again.
        assert!(!ends_after("World, hi", "", 7, "World"));
        assert!(ends_after("World, hi", "", 4, "World"));
        // Ending in text held back for an incomplete character (a token " \xe2\x80").
        assert!(ends_after("Answer:", " \u{FFFD}", 7, ": "));
        assert!(!ends_after("Answer:", " \u{FFFD}", 7, ":\n"));
        // The search starts on a character boundary (byte 1 is inside "é").
        assert!(ends_after("éab", "", 2, "ab"));
        assert!(!ends_after("né", "", 3, "x"));
        assert!(ends_after("abc", "", 0, "abc"));
    }
}
