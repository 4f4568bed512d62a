//! The engine worker: one thread that owns the model and the prefix cache and serves requests
//! first come, first served (a fair FIFO queue; continuous batching is not built yet).
//!
//! Per request: tokenised prompt -> token digest chain -> leading blocks from the prefix cache
//! (or paged in from kvagent) copied into the sequence's KV -> chunked prefill of the rest ->
//! new full prompt blocks stored (and written through to kvagent) -> sampled decode, streamed as
//! [`Event`]s until EOS, a stop string or `max_tokens`.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvmesh_filters::chain::{token_chain, Digest, Namespace};
use tch::{Kind, Tensor};
use tokio::sync::mpsc;

use crate::cache::{KvBlock, PrefixCache, BLOCK_TOKENS};
use crate::model::{KvCache, Llama};
use crate::tokenizer::ModelTokenizer;

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
    /// Requests waiting in the queue.
    pub waiting: AtomicU64,
    /// Requests running (0 or 1).
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
    /// Page-ins from kvagent that failed (treated as misses).
    pub pagein_errors: AtomicU64,
    /// Blocks whose write-through to kvagent was dropped: too many were in flight.
    pub writethrough_dropped_blocks: AtomicU64,
    /// Write-through `PutBlocks` calls that failed or timed out.
    pub writethrough_failed: AtomicU64,
    /// Times kvagent was found to have lost its blocks (a new `kv_epoch`) and the cached
    /// blocks were written through again.
    pub writethrough_resyncs: AtomicU64,
}

/// The worker's state.
pub struct Worker {
    model: Llama,
    tokenizer: Arc<ModelTokenizer>,
    cache: PrefixCache,
    /// The unsalted namespace, and the model name salted ones are derived from.
    ns: Namespace,
    model_name: String,
    prefill_chunk: usize,
    store: Option<Box<dyn BlockStore>>,
    stats: Arc<Stats>,
    /// Blocks the current request added to the pool (paged in or computed): dropped from it if
    /// the request fails. Blocks it only read stay: they were copied into its own KV buffer,
    /// never written, and other requests' prefixes depend on them.
    created: Vec<Digest>,
}

impl Worker {
    /// A worker over a loaded model.
    pub fn new(
        model: Llama,
        tokenizer: Arc<ModelTokenizer>,
        model_name: &str,
        cache_blocks: usize,
        prefill_chunk: usize,
        store: Option<Box<dyn BlockStore>>,
        stats: Arc<Stats>,
    ) -> Self {
        Worker {
            model,
            tokenizer,
            cache: PrefixCache::new(cache_blocks),
            ns: Namespace::new(model_name, b""),
            model_name: model_name.to_string(),
            prefill_chunk: prefill_chunk.max(1),
            store,
            stats,
            created: Vec::new(),
        }
    }

    /// Serves jobs until the queue closes. A job that fails (or panics) inside the model gets
    /// [`Event::Failed`]; the blocks it added leave the pool and the next job is served.
    pub fn run(mut self, jobs: std::sync::mpsc::Receiver<Job>) {
        let _no_grad = tch::no_grad_guard();
        while let Ok(job) = jobs.recv() {
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                continue;
            }
            self.stats.running.store(1, Ordering::Relaxed);
            let last = self.serve_one(&job);
            // The load gauges change before the answer can complete: a client that reads
            // /metrics right after its response sees its request finished.
            self.stats.running.store(0, Ordering::Relaxed);
            for ev in last {
                let _ = job.events.send(ev);
            }
        }
    }

    /// Serves one job, isolating its failure; returns the events still to send (the final text
    /// and `Done`, or `Failed`).
    fn serve_one(&mut self, job: &Job) -> Vec<Event> {
        self.created.clear();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.serve(job)));
        let message = match outcome {
            Ok(Ok(last)) => return last,
            Ok(Err(e)) => e.to_string(),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(error = %what, prompt = job.prompt.len(), "request failed in the engine; serving the next");
                format!("the engine failed while serving this request: {what}")
            }
        };
        self.stats.requests_failed.fetch_add(1, Ordering::Relaxed);
        // Whatever the failed request put into the pool is not trusted (what it only read is
        // unchanged: blocks are copied out, never written in place).
        for d in self.created.drain(..) {
            self.cache.remove(&d);
        }
        self.stats
            .cache_blocks
            .store(self.cache.len() as u64, Ordering::Relaxed);
        vec![Event::Failed { message }]
    }

    /// Reuses cached leading blocks (paging missing ones in from the store), prefills the rest
    /// in chunks; returns the last position's logits and the cached token count.
    fn prefill(&mut self, prompt: &[u32], salt: &str, kv: &mut KvCache) -> (Tensor, usize) {
        let chain = if salt.is_empty() {
            token_chain(&self.ns, prompt, BLOCK_TOKENS)
        } else {
            token_chain(
                &Namespace::new(&self.model_name, salt.as_bytes()),
                prompt,
                BLOCK_TOKENS,
            )
        };
        // At least one prompt token is always computed: its logits start the answer.
        let usable = prompt.len().saturating_sub(1) / BLOCK_TOKENS;
        let mut local = self.cache.leading(&chain[..usable.min(chain.len())]);
        if let Some(store) = self.store.as_mut() {
            let want = &chain[local..usable.min(chain.len())];
            if !want.is_empty() {
                let got = store.get_leading(want);
                let mut paged = 0;
                for (d, bytes) in want.iter().zip(got) {
                    match KvBlock::from_bytes(&self.model.cfg, &bytes) {
                        Some(b) => {
                            self.cache.insert(*d, b);
                            self.created.push(*d);
                            paged += 1;
                        }
                        None => break,
                    }
                }
                self.stats
                    .paged_in_tokens
                    .fetch_add((paged * BLOCK_TOKENS) as u64, Ordering::Relaxed);
                local = self.cache.leading(&chain[..usable.min(chain.len())]);
            }
        }
        self.cache.load(&chain, local, kv);
        let cached = local * BLOCK_TOKENS;
        let mut logits = None;
        for chunk in prompt[cached..].chunks(self.prefill_chunk) {
            logits = Some(self.model.forward(chunk, kv, true));
        }
        // New full prompt blocks join the pool (and kvagent).
        let mut fresh = Vec::new();
        for (i, d) in chain.iter().enumerate().skip(local) {
            if !self.cache.contains(d) {
                let block = KvBlock::from_sequence(kv, i);
                if self.store.is_some() {
                    fresh.push((*d, block.to_bytes()));
                }
                self.cache.insert(*d, block);
                self.created.push(*d);
            }
        }
        if let (Some(store), false) = (self.store.as_mut(), fresh.is_empty()) {
            store.put(fresh);
        }
        // After this request's own new blocks, which must not lose their place to it.
        self.resync_if_lost();
        self.stats
            .cache_blocks
            .store(self.cache.len() as u64, Ordering::Relaxed);
        (
            logits.unwrap_or_else(|| Tensor::zeros([1, 1], (Kind::Float, tch::Device::Cpu))),
            cached,
        )
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

    /// Prefill and decode; returns the events still to send (empty when the client left).
    fn serve(&mut self, job: &Job) -> Result<Vec<Event>, ServeError> {
        let p = &job.params;
        let started = std::time::Instant::now();
        let context = self.model.cfg.context;
        if job.prompt.is_empty() {
            return Err(ServeError::EmptyPrompt);
        }
        let capacity = job
            .prompt
            .len()
            .checked_add(p.max_tokens)
            .filter(|&n| n <= context)
            .ok_or(ServeError::TooLong {
                prompt: job.prompt.len(),
                max_tokens: p.max_tokens,
                context,
            })?;
        let mut kv = KvCache::new(&self.model.cfg, capacity + 1);
        let (mut logits, cached) = self.prefill(&job.prompt, &job.cache_salt, &mut kv);
        let prefilled = started.elapsed();
        self.stats
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        self.stats
            .cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        let _ = job.events.send(Event::Started {
            prompt_tokens: job.prompt.len(),
            cached_tokens: cached,
        });
        let mut rng = fastrand::Rng::with_seed(p.seed.unwrap_or_else(|| fastrand::u64(..)));
        let mut generated: Vec<u32> = Vec::new();
        let mut sent = 0usize; // bytes of text already sent
        let mut finish = "length";
        while generated.len() < p.max_tokens {
            let next = sample(&logits, p, &mut rng);
            if next == self.tokenizer.eos {
                finish = "stop";
                break;
            }
            generated.push(next);
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let text = self.tokenizer.decode(&generated).unwrap_or_default();
            if p.stop.iter().any(|s| text.contains(s.as_str())) {
                finish = "stop";
                break;
            }
            // Hold back an incomplete UTF-8 sequence, and text that may begin a stop string.
            let hold = p
                .stop
                .iter()
                .map(|s| longest_suffix_prefix(&text, s))
                .max()
                .unwrap_or(0);
            let mut upto = text.len() - hold;
            while upto > sent && !text.is_char_boundary(upto) {
                upto -= 1;
            }
            if job.stream && !text[..upto].ends_with('\u{FFFD}') && upto > sent {
                if job
                    .events
                    .send(Event::Text(text[sent..upto].to_string()))
                    .is_err()
                {
                    return Ok(Vec::new()); // client gone
                }
                sent = upto;
            }
            if generated.len() == p.max_tokens {
                break;
            }
            if job.events.is_closed() {
                return Ok(Vec::new()); // client gone
            }
            logits = self.model.forward(&[next], &mut kv, true);
        }
        let text = self.tokenizer.decode(&generated).unwrap_or_default();
        let text = match p.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            Some(cut) => &text[..cut],
            None => &text[..],
        };
        let mut last = Vec::with_capacity(2);
        if text.len() > sent {
            last.push(Event::Text(text[sent..].to_string()));
        }
        let decode = started.elapsed() - prefilled;
        tracing::debug!(
            prompt = job.prompt.len(),
            cached,
            prefill_ms = prefilled.as_secs_f64() * 1e3,
            generated = generated.len(),
            decode_ms_per_token = decode.as_secs_f64() * 1e3 / generated.len().max(1) as f64,
            "request done"
        );
        last.push(Event::Done {
            finish_reason: finish,
            completion_tokens: generated.len(),
        });
        Ok(last)
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
    use super::{longest_suffix_prefix, pick, SamplingParams};

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
}
