//! The Llama forward pass on libtorch: RMSNorm, grouped-query attention, RoPE in GGML's
//! adjacent-pair ("normal") form, SwiGLU, tied output embedding when the file has no
//! `output.weight`. The residual stream, norms and softmax are f32; the matrix weights are held
//! as [`WeightType`] says. Q, K and V are one matrix, gate and up another, so a layer is four
//! matrix products whatever the batch.
//!
//! Each sequence's KV lives in its own [`KvCache`], one buffer per layer that grows as the
//! sequence does. [`Llama::forward_batch`] runs one step over several sequences at once: their
//! new tokens (a decode token each, or a prefill chunk) are stacked into one matrix for every
//! product, and only attention runs per sequence (each over its own cache). With Q8_0 weights a
//! step's decode chunks are a pass of their own, whose norms, RoPE and SwiGLU run on plain f32
//! rows between candle's products ([`Llama::forward_batch`]).

use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, MutexGuard, PoisonError};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::Module;
use tch::{Kind, Tensor};

use crate::gguf::{Gguf, GgufError};

/// Why a model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file is unreadable or lacks something.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Not an architecture this engine implements.
    #[error("unsupported architecture {0:?}: engine-shim implements \"llama\"")]
    Architecture(String),
    /// Inconsistent hyperparameters or tensor shapes.
    #[error("inconsistent model: {0}")]
    Shape(String),
}

/// Hyperparameters read from the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Layers.
    pub n_layer: usize,
    /// Embedding width.
    pub d_model: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA).
    pub n_kv_head: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// Context length the model was trained for, at most [`MAX_CONTEXT`] and
    /// [`MAX_ROPE_VALUES`] / `head_dim` (positions past it are not served).
    pub context: usize,
    /// RoPE base.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Vocabulary size.
    pub vocab: usize,
}

impl LlamaConfig {
    /// Bytes of KV one token holds in a [`KvCache`] (keys and values, every layer, f32).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.n_kv_head * self.head_dim * 4
    }
}

/// How the matrix weights are held and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightType {
    /// f32: the reference precision.
    #[default]
    F32,
    /// bfloat16 weights and matmul inputs (norms, softmax and the residual stream stay f32):
    /// half the memory traffic per token, and AVX-512 BF16 kernels where the CPU has them.
    Bf16,
    /// Decode tokens through GGML's Q8_0 (int8 with an f16 scale per 32 weights, requantised
    /// at load from what the file holds) with candle's GGML kernels, which quantise the
    /// activations to 8 bits too (with AVX-512 VNNI, one scale per 256 values); prompt tokens
    /// through f32 matrices kept beside them, where a GEMM over many rows is faster. Which
    /// path a row takes depends only on whether it is a decode token ([`Chunk::decode`]), so
    /// a sequence's numbers do not depend on what else shares its step.
    Q8_0,
}

impl WeightType {
    /// The name used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::Bf16 => "bf16",
            WeightType::Q8_0 => "q8_0",
        }
    }
}

impl std::str::FromStr for WeightType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WeightType::F32),
            "bf16" => Ok(WeightType::Bf16),
            "q8_0" => Ok(WeightType::Q8_0),
            other => Err(format!("{other:?}: use f32, bf16 or q8_0")),
        }
    }
}

/// The most positions served, whatever the file's `context_length` says (Llama 3.1's 128k).
pub const MAX_CONTEXT: usize = 1 << 17;

/// The most values one RoPE table may hold (64 MiB of f32): the cosine and sine tables are
/// built for every position at load, `head_dim` values a position, and copied once more with
/// Q8_0, so the context is believed only as far as `MAX_ROPE_VALUES / head_dim` (131,072
/// positions at 128-wide heads, 2,048 at a hostile file's 8,192).
pub const MAX_ROPE_VALUES: usize = 1 << 24;

/// The tensors each layer holds: Q, K, V, output, gate, up, down and the two norms.
const TENSORS_PER_LAYER: usize = 9;

/// candle's repacked x86 kernels need the inner dimension in whole 256-value superblocks.
const Q8_K_MULTIPLE: usize = 256;

/// A weight matrix `W` (`[out, in]`) applied to f32 rows as `x W^T` by libtorch.
struct Linear {
    /// `W^T` (`[in, out]`) in f32 or bf16, for libtorch's GEMM.
    wt: Tensor,
    kind: Kind,
}

/// Holds libtorch at one intra-op thread on this thread while it lives (the decode pass of a
/// Q8_0 step), and gives back the count it found when dropped, unwinding included.
///
/// In that pass libtorch runs only small ops (the embedding lookup, attention over each
/// sequence's cache), whose OpenMP fan-out costs more than it gains, while candle's pool, which
/// runs the matrix products, keeps a worker spinning on the other core between them (the
/// pass's attention runs on that worker too: [`Llama::attend`]). Measured before it did,
/// with `decode_step` (256-token context, 2 cores): 11.0-11.3 ms a step against 11.6-11.9 with
/// two threads, and 39.8-39.9 against 44.9-59.8 ms at 8 sequences. A step's prompt pass runs
/// after the guard has dropped, with every thread: its f32 GEMMs need them.
struct OneTorchThread(i32);

impl OneTorchThread {
    /// One thread for libtorch on this thread until the guard drops.
    fn hold() -> Self {
        let n = tch::get_num_threads();
        if n > 1 {
            tch::set_num_threads(1);
        }
        OneTorchThread(n)
    }
}

impl Drop for OneTorchThread {
    fn drop(&mut self) {
        if self.0 > 1 {
            tch::set_num_threads(self.0);
        }
    }
}

/// A weight matrix `W` (`[out, in]`) as Q8_0 blocks for candle's kernels, with `in` (`k`)
/// zero-padded to `k_pad`.
struct Q8Matrix {
    m: QMatMul,
    k: usize,
    k_pad: usize,
}

/// A failure inside candle's kernels is a broken invariant (shapes are fixed at load), so it
/// panics as libtorch's ops do; the worker catches it and fails only that step's sequences.
fn q8_failed(e: candle_core::Error) -> ! {
    panic!("Q8_0 matrix product failed: {e}")
}

impl Q8Matrix {
    fn new(w: &Tensor) -> Result<Q8Matrix, ModelError> {
        let (n, k) = w
            .size2()
            .map_err(|e| ModelError::Shape(format!("a weight matrix is not 2-D: {e}")))?;
        let (n, k) = (n as usize, k as usize);
        let k_pad = k.next_multiple_of(Q8_K_MULTIPLE);
        let padded = Tensor::zeros([n as i64, k_pad as i64], (Kind::Float, tch::Device::Cpu));
        padded.narrow(1, 0, k as i64).copy_(w);
        let data = Vec::<f32>::try_from(padded.view([-1]))
            .map_err(|e| ModelError::Shape(format!("weight matrix: {e}")))?;
        let q = candle_core::Tensor::from_vec(data, (n, k_pad), &candle_core::Device::Cpu)
            .and_then(|t| QTensor::quantize(&t, GgmlDType::Q8_0))
            .and_then(QMatMul::from_qtensor)
            .map_err(|e| ModelError::Shape(format!("Q8_0 quantisation: {e}")))?;
        // candle repacks the blocks for its x86 kernels on first use: do it now, so the first
        // request does not pay for it and the memory shows at start.
        candle_core::Tensor::zeros(
            (1, k_pad),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .and_then(|x| q.forward(&x))
        .map_err(|e| ModelError::Shape(format!("Q8_0 product: {e}")))?;
        Ok(Q8Matrix { m: q, k, k_pad })
    }

    /// Rows of `k` values, concatenated, times `W^T`: `out` values per row.
    fn apply_rows(&self, rows: &[f32]) -> Vec<f32> {
        debug_assert_eq!(rows.len() % self.k, 0);
        let t = rows.len() / self.k;
        let mut buf = vec![0f32; t * self.k_pad];
        for (dst, src) in buf.chunks_mut(self.k_pad).zip(rows.chunks(self.k)) {
            dst[..self.k].copy_from_slice(src);
        }
        candle_core::Tensor::from_vec(buf, (t, self.k_pad), &candle_core::Device::Cpu)
            .and_then(|xt| self.m.forward(&xt))
            .and_then(|y| y.flatten_all())
            .and_then(|y| y.to_vec1::<f32>())
            .unwrap_or_else(|e| q8_failed(e))
    }
}

/// An f32 tensor's values in row-major order (a broken invariant panics, as libtorch's ops do).
fn f32_values(x: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(x.contiguous().view([-1])).unwrap_or_else(|e| panic!("f32 rows: {e}"))
}

impl Linear {
    /// `w` (f32) held in `kind` (f32 or bf16).
    fn new(w: &Tensor, kind: Kind) -> Linear {
        Linear {
            wt: w.tr().contiguous().to_kind(kind),
            kind,
        }
    }

    fn dense(&self, x: &Tensor) -> Tensor {
        if self.kind == Kind::Float {
            x.matmul(&self.wt)
        } else {
            x.to_kind(self.kind).matmul(&self.wt).to_kind(Kind::Float)
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    /// Q, K and V stacked (`[d + 2 kvd, d]`).
    wqkv: Linear,
    wo: Linear,
    ffn_norm: Tensor,
    /// Gate and up stacked (`[2 ffn, d]`).
    w_gate_up: Linear,
    w_down: Linear,
}

/// A loaded model.
pub struct Llama {
    /// Hyperparameters.
    pub cfg: LlamaConfig,
    embd: Tensor,
    output: Linear,
    out_norm: Tensor,
    layers: Vec<Layer>,
    /// cos and signed sin of RoPE angles for every position, each value twice (once per
    /// element of its pair), `[context, head_dim]` ([`rope`]).
    rope_cos: Tensor,
    rope_sin: Tensor,
    /// With Q8_0 weights: what the decode pass of a step runs on.
    q8: Option<Q8Decode>,
}

/// The key/value cache of one sequence: per layer `[n_kv_head, capacity, head_dim]`, grown by
/// [`KvCache::reserve`] (a copy into a larger buffer) as the sequence lengthens.
///
/// Keys are stored after RoPE, so a slot keeps its token's original position whatever is
/// evicted around it (`crate::evict`): slots are filled in position order, and eviction keeps
/// that order, but once anything is evicted slot `i` no longer holds position `i` (`len` slots
/// held, `pos` tokens appended).
pub struct KvCache {
    /// Keys per layer: views of buffers laid out `[n_kv_head, head_dim, capacity]`
    /// (`kv_buffer`), so a key is not one contiguous row; read and write them through the view.
    pub k: Vec<Tensor>,
    /// Values per layer.
    pub v: Vec<Tensor>,
    /// Slots filled.
    pub len: usize,
    /// Slots available.
    pub capacity: usize,
    /// Tokens appended so far: the RoPE position of the next one (`len` until an eviction).
    pub pos: usize,
    /// The position each slot holds, while every layer and head hold the same ones; `None`
    /// once a per-head eviction (H2O) made them differ.
    slot_pos: Option<Vec<u32>>,
    /// Attention each slot has received so far, per layer `[n_kv_head, capacity]` (summed over
    /// the kv head's query heads and every query since the slot was written): kept only when
    /// [`KvCache::track_attention`] asked for it (H2O's heavy hitters).
    attention: Option<Vec<Tensor>>,
}

impl KvCache {
    /// An empty cache for `capacity` positions.
    pub fn new(cfg: &LlamaConfig, capacity: usize) -> Self {
        let make = |keys| {
            (0..cfg.n_layer)
                .map(|_| kv_buffer(cfg, capacity, keys))
                .collect()
        };
        KvCache {
            k: make(true),
            v: make(false),
            len: 0,
            capacity,
            pos: 0,
            slot_pos: Some(Vec::new()),
            attention: None,
        }
    }

    /// Accumulates, from now on, the attention every slot receives (before anything is written).
    pub fn track_attention(&mut self, cfg: &LlamaConfig) {
        self.attention = Some(
            (0..cfg.n_layer)
                .map(|_| attention_buffer(cfg, self.capacity))
                .collect(),
        );
    }

    /// The accumulated attention of layer `layer` (`[n_kv_head, len]`), when tracked.
    pub fn attention(&self, layer: usize) -> Option<Tensor> {
        self.attention
            .as_ref()
            .and_then(|a| a.get(layer))
            .map(|t| t.narrow(1, 0, self.len as i64))
    }

    /// The position of each slot, while all layers and heads hold the same ones.
    pub fn positions(&self) -> Option<&[u32]> {
        self.slot_pos.as_deref()
    }

    /// Grows the buffers to hold at least `capacity` positions (keeping what is filled).
    pub fn reserve(&mut self, cfg: &LlamaConfig, capacity: usize) {
        if capacity <= self.capacity {
            return;
        }
        let len = self.len as i64;
        for (t, keys) in self.buffers_mut() {
            let bigger = kv_buffer(cfg, capacity, keys);
            bigger.narrow(1, 0, len).copy_(&t.narrow(1, 0, len));
            *t = bigger;
        }
        for t in self.attention.iter_mut().flatten() {
            let bigger = attention_buffer(cfg, capacity);
            bigger.narrow(1, 0, len).copy_(&t.narrow(1, 0, len));
            *t = bigger;
        }
        self.capacity = capacity;
    }

    /// Adds what layer `layer`'s slots received in a step (`received`: `[n_kv_head, len + new]`,
    /// the step's new slots from `len` on, before [`KvCache::advance`]) to their accumulated
    /// attention; nothing when attention is not tracked.
    pub fn add_attention(&mut self, layer: usize, received: &Tensor) {
        let n = received.size().get(1).copied().unwrap_or(0);
        if let Some(acc) = self.attention.as_mut().and_then(|a| a.get_mut(layer)) {
            // The new slots may hold what an evicted slot left there.
            let _ = acc.narrow(1, self.len as i64, n - self.len as i64).zero_();
            let mut held = acc.narrow(1, 0, n);
            held += received;
        }
    }

    /// `n` tokens were written after the filled slots: they are held now.
    pub fn advance(&mut self, n: usize) {
        if let Some(p) = self.slot_pos.as_mut() {
            p.extend((self.pos..self.pos + n).map(|x| x as u32));
        }
        self.len += n;
        self.pos += n;
    }

    /// Every layer's key and value buffers, each with whether it holds keys.
    fn buffers_mut(&mut self) -> impl Iterator<Item = (&mut Tensor, bool)> {
        let keys = self.k.iter_mut().map(|t| (t, true));
        keys.chain(self.v.iter_mut().map(|t| (t, false)))
    }

    /// Keeps only the slots `keep` (ascending, each below `len`), in every layer and head, in
    /// new buffers of `keep.len() + headroom` slots: the memory of what is dropped is freed.
    pub fn retain(&mut self, cfg: &LlamaConfig, keep: &[usize], headroom: usize) {
        let idx = Tensor::from_slice(&keep.iter().map(|&i| i as i64).collect::<Vec<_>>());
        let n = keep.len() as i64;
        let capacity = keep.len() + headroom;
        for (t, keys) in self.buffers_mut() {
            let smaller = kv_buffer(cfg, capacity, keys);
            smaller.narrow(1, 0, n).copy_(&t.index_select(1, &idx));
            *t = smaller;
        }
        for t in self.attention.iter_mut().flatten() {
            let smaller = attention_buffer(cfg, capacity);
            smaller.narrow(1, 0, n).copy_(&t.index_select(1, &idx));
            *t = smaller;
        }
        if let Some(p) = self.slot_pos.as_mut() {
            *p = keep.iter().filter_map(|&i| p.get(i).copied()).collect();
        }
        self.len = keep.len();
        self.capacity = capacity;
    }

    /// Keeps, in each layer and kv head, its own slots: `keep[layer]` is `[n_kv_head, m]`
    /// (int64, ascending along each row, each below `len`), the same `m` for every layer. The
    /// buffers are rebuilt with `m + headroom` slots; slot positions are no longer shared.
    pub fn retain_per_head(&mut self, cfg: &LlamaConfig, keep: &[Tensor], headroom: usize) {
        let Some(m) = keep.first().map(|t| t.size()[1]) else {
            return;
        };
        let capacity = m as usize + headroom;
        let hd = cfg.head_dim as i64;
        for (layer, idx) in keep.iter().enumerate() {
            let wide = idx.unsqueeze(-1).expand([-1, -1, hd], false);
            for (t, keys) in [(&mut self.k[layer], true), (&mut self.v[layer], false)] {
                let smaller = kv_buffer(cfg, capacity, keys);
                smaller.narrow(1, 0, m).copy_(&t.gather(1, &wide, false));
                *t = smaller;
            }
            if let Some(a) = self.attention.as_mut().and_then(|a| a.get_mut(layer)) {
                let smaller = attention_buffer(cfg, capacity);
                smaller.narrow(1, 0, m).copy_(&a.gather(1, idx, false));
                *a = smaller;
            }
        }
        self.slot_pos = None;
        self.len = m as usize;
        self.capacity = capacity;
    }
}

/// A layer's zeroed key or value buffer, `[n_kv_head, capacity, head_dim]` as every reader
/// sees it. Keys lie in memory as `[n_kv_head, head_dim, capacity]` (the view is transposed):
/// the scores' product then reads them as they lie, where MKL first packed the transposed
/// keys of the other layout (measured: attention ~20% faster for 8 sequences at 300 slots).
fn kv_buffer(cfg: &LlamaConfig, capacity: usize, keys: bool) -> Tensor {
    let (kvh, cap, hd) = (cfg.n_kv_head as i64, capacity as i64, cfg.head_dim as i64);
    let opts = (Kind::Float, tch::Device::Cpu);
    if keys {
        Tensor::zeros([kvh, hd, cap], opts).transpose(1, 2)
    } else {
        Tensor::zeros([kvh, cap, hd], opts)
    }
}

fn attention_buffer(cfg: &LlamaConfig, capacity: usize) -> Tensor {
    Tensor::zeros(
        [cfg.n_kv_head as i64, capacity as i64],
        (Kind::Float, tch::Device::Cpu),
    )
}

/// One sequence's part of a batched step: `tokens` appended to `kv`.
pub struct Chunk<'a> {
    /// The new tokens (one to decode, or a prefill chunk).
    pub tokens: &'a [u32],
    /// The sequence's cache; must have room for `tokens` ([`KvCache::reserve`]).
    pub kv: &'a mut KvCache,
    /// Whether the logits of the chunk's last token are wanted.
    pub logits: bool,
    /// Whether `tokens` is a token the model generated (decode), not prompt: with
    /// [`WeightType::Q8_0`] decode tokens go through the Q8_0 kernels, prompt tokens through f32.
    pub decode: bool,
}

fn weight(g: &Gguf, name: &str, want: &[i64]) -> Result<Tensor, ModelError> {
    let (data, shape) = g.dequantize(name)?;
    if shape != want {
        return Err(ModelError::Shape(format!(
            "{name} has shape {shape:?}, expected {want:?}"
        )));
    }
    Ok(Tensor::from_slice(&data).reshape(&shape))
}

/// The matrices `names` (each `[rows_i, cols]`, multiplied by `factors_i`) stacked by rows.
fn stacked(
    g: &Gguf,
    names: &[String],
    rows: &[i64],
    factors: &[f64],
    cols: i64,
) -> Result<Tensor, ModelError> {
    let mut ws = Vec::with_capacity(names.len());
    for ((name, &r), &factor) in names.iter().zip(rows).zip(factors) {
        let w = weight(g, name, &[r, cols])?;
        ws.push(if factor == 1.0 { w } else { w * factor });
    }
    Ok(Tensor::cat(&ws, 0))
}

/// RoPE on `x` `[T, heads, head_dim]`, rotating adjacent pairs (2i, 2i+1) as GGML does for
/// Llama GGUFs, as `x cos + swap(x) sin` with per-row `cos` (each angle's cosine twice) and
/// `sin` (each angle's sine as `(-sin, sin)`), both `[T, 1, head_dim]`: six ops, not eleven.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (t, h, hd) = x.size3().unwrap_or((0, 0, 0));
    let swapped = x.view([t, h, hd / 2, 2]).flip([-1]).view([t, h, hd]);
    x * cos + swapped * sin
}

impl Llama {
    /// Loads a Llama-architecture GGUF, holding the matrix weights as `weights`.
    pub fn load(g: &Gguf, weights: WeightType) -> Result<Self, ModelError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Architecture(arch.to_string()));
        }
        let u = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let d_model = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = u("attention.head_count_kv")?;
        let ffn = u("feed_forward_length")?;
        if d_model == 0
            || n_head == 0
            || n_kv_head == 0
            || !d_model.is_multiple_of(n_head)
            || !n_head.is_multiple_of(n_kv_head)
            || !(d_model / n_head).is_multiple_of(2)
        {
            return Err(ModelError::Shape(format!(
                "{n_head} heads, {n_kv_head} kv heads, width {d_model}"
            )));
        }
        let head_dim = d_model / n_head;
        let vocab = g
            .tensors
            .get("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?
            as usize;
        // The layer count and the context size buffers and tables before any tensor is read:
        // a layer count is believed only as far as the file holds that many layers' tensors.
        let n_layer = u("block_count")?;
        if n_layer == 0 || n_layer > g.tensors.len() / TENSORS_PER_LAYER {
            return Err(ModelError::Shape(format!(
                "{n_layer} layers, but the file holds {} tensors ({TENSORS_PER_LAYER} a layer)",
                g.tensors.len()
            )));
        }
        let context = u("context_length")?;
        if context == 0 || vocab == 0 {
            return Err(ModelError::Shape(format!(
                "a context of {context} positions and a vocabulary of {vocab} tokens"
            )));
        }
        let cfg = LlamaConfig {
            n_layer,
            d_model,
            n_head,
            n_kv_head,
            head_dim,
            ffn,
            context: context
                .min(MAX_CONTEXT)
                .min(MAX_ROPE_VALUES / head_dim)
                .max(1),
            rope_base: g.get_f64("llama.rope.freq_base").unwrap_or(10_000.0),
            eps: g.get_f64("llama.attention.layer_norm_rms_epsilon")?,
            vocab,
        };
        let (d, kvd, f) = (d_model as i64, (n_kv_head * head_dim) as i64, ffn as i64);
        let embd = weight(g, "token_embd.weight", &[vocab as i64, d])?;
        // Tied embeddings when there is no separate output matrix.
        let out_w = if g.tensors.contains_key("output.weight") {
            weight(g, "output.weight", &[vocab as i64, d])?
        } else {
            embd.shallow_clone()
        };
        let kind = match weights {
            WeightType::Bf16 => Kind::BFloat16,
            WeightType::F32 | WeightType::Q8_0 => Kind::Float,
        };
        let with_q8 = weights == WeightType::Q8_0;
        // The output matrix first: quantising it takes ~300 MB of f32 copies for a moment,
        // which then do not come on top of every layer's matrices (peak RSS).
        let q8_output = with_q8.then(|| Q8Matrix::new(&out_w)).transpose()?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let mut q8_layers = Vec::new();
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let wqkv = stacked(
                g,
                &[n("attn_q"), n("attn_k"), n("attn_v")],
                &[d, kvd, kvd],
                // Attention's 1/sqrt(head_dim) folded into Q (RoPE is linear): one op less per
                // layer, and exact for power-of-two head widths.
                &[1.0 / (head_dim as f64).sqrt(), 1.0, 1.0],
                d,
            )?;
            let wo = stacked(g, &[n("attn_output")], &[d], &[1.0], d)?;
            let w_gate_up = stacked(g, &[n("ffn_gate"), n("ffn_up")], &[f, f], &[1.0, 1.0], d)?;
            let w_down = stacked(g, &[n("ffn_down")], &[d], &[1.0], f)?;
            let (attn_norm, ffn_norm) = (
                weight(g, &n("attn_norm"), &[d])?,
                weight(g, &n("ffn_norm"), &[d])?,
            );
            if with_q8 {
                q8_layers.push(Q8Layer {
                    norms: [f32_values(&attn_norm), f32_values(&ffn_norm)],
                    wqkv: Q8Matrix::new(&wqkv)?,
                    wo: Q8Matrix::new(&wo)?,
                    w_gate_up: Q8Matrix::new(&w_gate_up)?,
                    w_down: Q8Matrix::new(&w_down)?,
                });
            }
            layers.push(Layer {
                attn_norm,
                wqkv: Linear::new(&wqkv, kind),
                wo: Linear::new(&wo, kind),
                ffn_norm,
                w_gate_up: Linear::new(&w_gate_up, kind),
                w_down: Linear::new(&w_down, kind),
            });
        }
        let half = (head_dim / 2) as i64;
        let inv_freq = Tensor::arange(half, (Kind::Float, tch::Device::Cpu))
            .g_mul_scalar(-2.0 / head_dim as f64)
            .exp2()
            .pow_tensor_scalar(cfg.rope_base.log2());
        let pos = Tensor::arange(cfg.context as i64, (Kind::Float, tch::Device::Cpu));
        let angles = pos.unsqueeze(1) * inv_freq.unsqueeze(0);
        let (ctx, hd) = (cfg.context as i64, head_dim as i64);
        let out_norm = weight(g, "output_norm.weight", &[d])?;
        let rope_cos = Tensor::stack(&[angles.cos(), angles.cos()], -1).view([ctx, hd]);
        let rope_sin = Tensor::stack(&[-angles.sin(), angles.sin()], -1).view([ctx, hd]);
        let q8 = q8_output.map(|output| Q8Decode {
            layers: q8_layers,
            output,
            out_norm: f32_values(&out_norm),
            rope_cos: f32_values(&rope_cos),
            rope_sin: f32_values(&rope_sin),
        });
        Ok(Llama {
            output: Linear::new(&out_w, kind),
            out_norm,
            rope_cos,
            rope_sin,
            embd,
            layers,
            cfg,
            q8,
        })
    }

    /// Refuses a tokenizer of `tokens` ids that this model cannot embed: an id past the
    /// embedding table fails every step that meets it (the BOS id: every request).
    pub fn check_vocabulary(&self, tokens: usize) -> Result<(), ModelError> {
        if tokens > self.cfg.vocab {
            return Err(ModelError::Shape(format!(
                "the tokenizer has {tokens} tokens but the model embeds {}",
                self.cfg.vocab
            )));
        }
        Ok(())
    }

    fn norm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.rms_norm([self.cfg.d_model as i64], Some(w), self.cfg.eps)
    }

    /// Appends `tokens` to the sequence in `cache` and returns the logits `[T, vocab]` of every
    /// new position (`last_only`: of the last one only, `[1, vocab]`). The cache grows as needed.
    /// One token counts as a decode token ([`Chunk::decode`]), more as prompt.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, last_only: bool) -> Tensor {
        cache.reserve(&self.cfg, cache.len + tokens.len());
        let mut chunk = Chunk {
            tokens,
            kv: cache,
            logits: true,
            decode: tokens.len() == 1,
        };
        if chunk.decode && self.q8.is_some() {
            return self.forward_batch(std::slice::from_mut(&mut chunk));
        }
        let (x, attention) = self.layers_over(&mut [&mut chunk]);
        let t = tokens.len() as i64;
        let x = if last_only { x.narrow(0, t - 1, 1) } else { x };
        let logits = self.output.dense(&self.norm(&x, &self.out_norm));
        for (layer, a) in attention.into_iter().flatten() {
            chunk.kv.add_attention(layer, &a);
        }
        chunk.kv.advance(tokens.len());
        logits
    }

    /// One batched step: appends each chunk's tokens to its sequence, and returns the logits
    /// (`[n, vocab]`) of the last token of each chunk that wants them, in order. Every cache must
    /// have room ([`KvCache::reserve`]); caches are advanced only once the whole step is done.
    ///
    /// With Q8_0 weights the decode chunks and the others are two passes of one step: the
    /// former through [`Llama::decode_layers`], the latter through f32 matrices. Chunks share
    /// nothing but their matrix products, which took the two kinds of rows apart in any case,
    /// so a decode token's logits do not depend on prompt chunks sharing its step (the decode
    /// pass's attention always runs on one libtorch thread a chunk: [`OneTorchThread`]).
    pub fn forward_batch(&self, chunks: &mut [Chunk<'_>]) -> Tensor {
        let decode_pass = |c: &Chunk<'_>| c.decode && self.q8.is_some();
        // Where each wanted row lands: the decode pass's rows come first.
        let n_decode = chunks.iter().filter(|c| c.logits && decode_pass(c)).count() as i64;
        let (mut next_decode, mut next_prompt) = (0, n_decode);
        let order: Vec<i64> = chunks
            .iter()
            .filter(|c| c.logits)
            .map(|c| {
                let next = if decode_pass(c) {
                    &mut next_decode
                } else {
                    &mut next_prompt
                };
                *next += 1;
                *next - 1
            })
            .collect();
        let (mut decode, mut prompt): (Vec<&mut Chunk<'_>>, Vec<&mut Chunk<'_>>) =
            chunks.iter_mut().partition(|c| decode_pass(c));
        let mut logits = Vec::new();
        let mut attention = Vec::new();
        if let (Some(q8), false) = (&self.q8, decode.is_empty()) {
            // The pass runs only small libtorch ops, its chunks' attention spread over candle's
            // threads; the prompt rows' GEMMs below get every thread back.
            let _threads = OneTorchThread::hold();
            let (x, a) = self.decode_layers(&mut decode, q8);
            logits.push(self.decode_logits(&x, &last_rows(&decode), q8));
            attention.extend(a);
        }
        if !prompt.is_empty() {
            let (x, a) = self.layers_over(&mut prompt);
            let x = x.index_select(0, &Tensor::from_slice(&last_rows(&prompt)));
            logits.push(self.output.dense(&self.norm(&x, &self.out_norm)));
            attention.extend(a);
        }
        let logits = match logits.len() {
            0 => self.no_logits(),
            1 => logits.remove(0),
            _ => Tensor::cat(&logits, 0),
        };
        let logits = if order.iter().enumerate().all(|(i, &o)| i as i64 == o) {
            logits
        } else {
            logits.index_select(0, &Tensor::from_slice(&order))
        };
        // Only now: a step that failed anywhere above left every cache as it was (a retried
        // chunk does not count its attention twice).
        for (ch, attention) in decode.iter_mut().chain(prompt.iter_mut()).zip(attention) {
            for (layer, a) in attention {
                ch.kv.add_attention(layer, &a);
            }
            ch.kv.advance(ch.tokens.len());
        }
        logits
    }

    /// The transformer over every chunk's tokens (their K and V written after each cache's
    /// `len` filled slots, at positions from its `pos`; the caller advances both); returns the
    /// final hidden states `[T, d]` and, per chunk whose cache tracks attention, the attention
    /// each of its slots received per layer (`[n_kv_head, len + T]`), for the caller to add.
    fn layers_over(&self, chunks: &mut [&mut Chunk<'_>]) -> (Tensor, Vec<Vec<(usize, Tensor)>>) {
        let c = &self.cfg;
        let (h, kvh, hd) = (c.n_head as i64, c.n_kv_head as i64, c.head_dim as i64);
        let (d, kvd) = (c.d_model as i64, kvh * hd);
        let (ids, pos) = tokens_and_positions(chunks);
        let t_all = ids.len() as i64;
        let mut x = self.embd.index_select(0, &Tensor::from_slice(&ids));
        let pos = Tensor::from_slice(&pos);
        let cos = self.rope_cos.index_select(0, &pos).unsqueeze(1);
        let sin = self.rope_sin.index_select(0, &pos).unsqueeze(1);
        let masks = causal_masks(chunks);
        let mut attention: Vec<Vec<(usize, Tensor)>> = chunks.iter().map(|_| Vec::new()).collect();
        for (li, l) in self.layers.iter().enumerate() {
            let hn = self.norm(&x, &l.attn_norm);
            let qkv = l.wqkv.dense(&hn);
            // Q (already scaled by 1/sqrt(head_dim)) and K rotated together.
            let qk = rope(
                &qkv.narrow(1, 0, d + kvd).reshape([t_all, h + kvh, hd]),
                &cos,
                &sin,
            );
            let q = qk.narrow(1, 0, h);
            let k = qk.narrow(1, h, kvh);
            let v = qkv.narrow(1, d + kvd, kvd).reshape([t_all, kvh, hd]);
            let attn = self.attend(li, [&q, &k, &v], chunks, &masks, &mut attention, false);
            x += l.wo.dense(&attn);
            let hn = self.norm(&x, &l.ffn_norm);
            let gu = l.w_gate_up.dense(&hn);
            let f = c.ffn as i64;
            let ff = gu.narrow(1, 0, f).silu() * gu.narrow(1, f, f);
            x += l.w_down.dense(&ff);
        }
        (x, attention)
    }

    /// [`Llama::layers_over`] for the decode pass of a step (Q8_0): between candle's products
    /// the residual stream, norms, RoPE and SwiGLU run on plain f32 rows (`[T * d]`), and
    /// libtorch only looks up the embeddings and runs attention. A pass of a few rows is a few
    /// thousand values per op, so libtorch's fixed cost per op, and the copies in and out of
    /// candle's tensors around each product, were about a sixth of a step (measured: 10.6-11.0
    /// against 12.4-12.8 ms at one sequence).
    fn decode_layers(
        &self,
        chunks: &mut [&mut Chunk<'_>],
        q8: &Q8Decode,
    ) -> (Vec<f32>, Vec<Vec<(usize, Tensor)>>) {
        let c = &self.cfg;
        let (h, kvh, hd) = (c.n_head, c.n_kv_head, c.head_dim);
        let (d, kvd) = (c.d_model, kvh * hd);
        let width = d + 2 * kvd;
        let (ids, pos) = tokens_and_positions(chunks);
        let t = ids.len() as i64;
        let mut x = f32_values(&self.embd.index_select(0, &Tensor::from_slice(&ids)));
        let masks = causal_masks(chunks);
        let mut attention: Vec<Vec<(usize, Tensor)>> = chunks.iter().map(|_| Vec::new()).collect();
        for (li, l) in q8.layers.iter().enumerate() {
            let mut qkv = l.wqkv.apply_rows(&rms_norm_rows(&x, &l.norms[0], c.eps));
            for (row, &p) in qkv.chunks_exact_mut(width).zip(&pos) {
                let (cos, sin) = q8.rope_row(p as usize, hd);
                rope_heads(&mut row[..d + kvd], cos, sin);
            }
            let qkv = Tensor::from_slice(&qkv).view([t, width as i64]);
            let part = |from: usize, heads: usize| {
                qkv.narrow(1, from as i64, (heads * hd) as i64).reshape([
                    t,
                    heads as i64,
                    hd as i64,
                ])
            };
            let (q, k, v) = (part(0, h), part(d, kvh), part(d + kvd, kvh));
            let attn = self.attend(li, [&q, &k, &v], chunks, &masks, &mut attention, true);
            add_rows(&mut x, &l.wo.apply_rows(&f32_values(&attn)));
            let gu = l
                .w_gate_up
                .apply_rows(&rms_norm_rows(&x, &l.norms[1], c.eps));
            add_rows(&mut x, &l.w_down.apply_rows(&swiglu_rows(&gu, c.ffn)));
        }
        (x, attention)
    }

    /// Logits for no rows: `[0, vocab]`.
    fn no_logits(&self) -> Tensor {
        Tensor::zeros([0, self.cfg.vocab as i64], (Kind::Float, tch::Device::Cpu))
    }

    /// The logits `[rows, vocab]` of the hidden states `x` (`[T * d]`) at `rows`.
    fn decode_logits(&self, x: &[f32], rows: &[i64], q8: &Q8Decode) -> Tensor {
        if rows.is_empty() {
            return self.no_logits();
        }
        let d = self.cfg.d_model;
        let mut picked = Vec::with_capacity(rows.len() * d);
        for &r in rows {
            picked.extend_from_slice(&x[r as usize * d..(r as usize + 1) * d]);
        }
        let normed = rms_norm_rows(&picked, &q8.out_norm, self.cfg.eps);
        let logits = q8.output.apply_rows(&normed);
        Tensor::from_slice(&logits).view([rows.len() as i64, self.cfg.vocab as i64])
    }

    /// Layer `li`'s attention for every chunk from the step's `[q, k, v]` (`[T, heads,
    /// head_dim]`; Q scaled, Q and K rotated): writes each chunk's keys and values after its
    /// cache's filled slots and returns the outputs `[T, d]`. For each chunk whose cache tracks
    /// attention, pushes what its slots received onto its entry of `received`.
    ///
    /// With `spread`, the chunks are shared out over candle's pool threads (this one among
    /// them), each chunk on one libtorch thread; the caller holds [`OneTorchThread`], so every
    /// chunk's numbers are the same whichever thread runs it. Chunks only meet in the products,
    /// so their attention is independent work, and a decode token's is a few small ops: on one
    /// thread, 8 sequences' attention took 15.5 ms of a 39.6 ms step (256-token contexts).
    fn attend(
        &self,
        li: usize,
        [q, k, v]: [&Tensor; 3],
        chunks: &mut [&mut Chunk<'_>],
        masks: &[Option<Tensor>],
        received: &mut [Vec<(usize, Tensor)>],
        spread: bool,
    ) -> Tensor {
        let mut off = 0i64;
        let jobs: Vec<ChunkAttention> = chunks
            .iter()
            .zip(masks)
            .map(|(ch, mask)| {
                let t = ch.tokens.len() as i64;
                off += t;
                ChunkAttention {
                    qkv: [q, k, v].map(Tensor::shallow_clone),
                    rows: (off - t, t),
                    keys: ch.kv.k[li].shallow_clone(),
                    vals: ch.kv.v[li].shallow_clone(),
                    start: ch.kv.len as i64,
                    mask: mask.as_ref().map(Tensor::shallow_clone),
                    track: ch.kv.attention.is_some(),
                }
            })
            .collect();
        let done = if spread && jobs.len() > 1 {
            spread_over_pool(jobs, &self.cfg)
        } else {
            jobs.into_iter().map(|j| j.run(&self.cfg)).collect()
        };
        let mut outs = Vec::with_capacity(done.len());
        for ((out, got), received) in done.into_iter().zip(received) {
            if let Some(got) = got {
                received.push((li, got));
            }
            outs.push(out);
        }
        if outs.len() == 1 {
            outs.remove(0)
        } else {
            Tensor::cat(&outs, 0)
        }
    }
}

/// One chunk's attention in one layer, holding its own handles on the tensors it reads and
/// writes (a `Tensor` may move to another thread but not be shared), so that chunks can run
/// on different threads.
struct ChunkAttention {
    /// The step's Q, K and V (`[T, heads, head_dim]`), of which the chunk's are `rows`: the
    /// job takes them itself, so that the calling thread does not, for every chunk, while the
    /// pool waits.
    qkv: [Tensor; 3],
    /// The chunk's rows of the step's Q, K and V: the first, and how many (its tokens).
    rows: (i64, i64),
    /// The layer's key and value buffers of the chunk's cache.
    keys: Tensor,
    vals: Tensor,
    /// Slots filled before the chunk.
    start: i64,
    /// The causal mask of a chunk of several tokens.
    mask: Option<Tensor>,
    /// Whether to return the attention each slot received.
    track: bool,
}

impl ChunkAttention {
    /// Writes the chunk's keys and values (its rows of the step's, `[t, heads, head_dim]`)
    /// after the `start` filled slots of the layer's cache buffers (`[kv_heads, capacity,
    /// head_dim]`); returns its output `[t, heads * head_dim]` and, with `track`, the attention
    /// each slot received (`[kv_heads, start + t]`).
    fn run(self, c: &LlamaConfig) -> (Tensor, Option<Tensor>) {
        let (first, t) = self.rows;
        let [q, k, v] = self.qkv.map(|x| x.narrow(0, first, t));
        let (h, kvh, hd) = (c.n_head as i64, c.n_kv_head as i64, c.head_dim as i64);
        let group = h / kvh;
        let total = self.start + t;
        self.keys.narrow(1, self.start, t).copy_(&k.transpose(0, 1));
        self.vals.narrow(1, self.start, t).copy_(&v.transpose(0, 1));
        // Batched over kv heads, with each kv head's `group` query heads stacked as rows: no
        // broadcast, so the cached keys and values are read in place.
        let keys = self.keys.narrow(1, 0, total); // [kvh, total, hd]
        let vals = self.vals.narrow(1, 0, total);
        // One token's heads already lie in that order: a view, where a chunk's need a copy.
        // Each libtorch op costs microseconds, and a decode step runs this for every
        // sequence and layer.
        let qg = if t == 1 {
            q.reshape([kvh, group, hd])
        } else {
            q.transpose(0, 1).contiguous().view([kvh, group * t, hd])
        };
        let scores = qg.bmm(&keys.transpose(1, 2));
        let scores = match &self.mask {
            Some(m) => scores
                .view([kvh, group, t, total])
                .masked_fill(m, f64::NEG_INFINITY)
                .view([kvh, group * t, total]),
            None => scores,
        };
        let probs = scores.softmax(-1, Kind::Float);
        let received = self
            .track
            .then(|| probs.sum_dim_intlist([1i64].as_slice(), false, Kind::Float));
        let out = probs.bmm(&vals); // [kvh, group * t, hd]
        let out = if t == 1 {
            out.view([1, h * hd])
        } else {
            out.view([h, t, hd]).transpose(0, 1).reshape([t, h * hd])
        };
        (out, received)
    }
}

/// What one job of [`spread_over_pool`] gave: its result, or the payload of its panic.
type JobResult = std::thread::Result<(Tensor, Option<Tensor>)>;

/// Runs `jobs` on candle's pool threads and this one, each job on one libtorch thread (the
/// caller holds [`OneTorchThread`]); returns their results in order. A panic in a job (a
/// libtorch op failing) reaches the caller as if the job had run here, but only once the pool
/// is done: a panic that unwound through candle's pool would poison the lock it takes for every
/// product, and every later step would fail.
fn spread_over_pool(jobs: Vec<ChunkAttention>, c: &LlamaConfig) -> Vec<(Tensor, Option<Tensor>)> {
    let todo: Vec<Mutex<Option<ChunkAttention>>> =
        jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let done: Vec<Mutex<Option<JobResult>>> = todo.iter().map(|_| Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(todo.len(), |range| {
        for i in range {
            let job = lock(&todo[i]).take();
            if let Some(job) = job {
                let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    // Grad mode is per thread. So is libtorch's thread count once a thread has
                    // used libtorch; a pool thread's first use takes the process-wide count,
                    // which the caller's guard has set to 1 unless another thread has just
                    // set it back. Setting it here sets that count as well, until a guard
                    // gives its own back.
                    let _no_grad = tch::no_grad_guard();
                    if tch::get_num_threads() != 1 {
                        tch::set_num_threads(1);
                    }
                    job.run(c)
                }));
                *lock(&done[i]) = Some(ran);
            }
        }
    });
    done.into_iter()
        .map(
            |d| match d.into_inner().unwrap_or_else(PoisonError::into_inner) {
                Some(Ok(got)) => got,
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                None => panic!("candle's pool left an attention job unrun"),
            },
        )
        .collect()
}

/// A job slot's lock; a panic in another job does not make it unusable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The row of each chunk's last token in a step of `chunks`, for those that want logits.
fn last_rows(chunks: &[&mut Chunk<'_>]) -> Vec<i64> {
    let mut rows = Vec::new();
    let mut at = 0i64;
    for c in chunks {
        at += c.tokens.len() as i64;
        if c.logits {
            rows.push(at - 1);
        }
    }
    rows
}

/// The step's token ids and their RoPE positions, chunk after chunk.
fn tokens_and_positions(chunks: &[&mut Chunk<'_>]) -> (Vec<i64>, Vec<i64>) {
    let mut ids = Vec::new();
    let mut pos = Vec::new();
    for ch in chunks {
        let start = ch.kv.pos as i64;
        ids.extend(ch.tokens.iter().map(|&x| x as i64));
        pos.extend(start..start + ch.tokens.len() as i64);
    }
    (ids, pos)
}

/// Per chunk, what its queries must not see: prefill chunks attend causally (query i sees every
/// held slot and the chunk's keys 0..=i; held slots are all earlier positions), one token sees
/// everything.
fn causal_masks(chunks: &[&mut Chunk<'_>]) -> Vec<Option<Tensor>> {
    chunks
        .iter()
        .map(|ch| {
            let (t, start) = (ch.tokens.len() as i64, ch.kv.len as i64);
            (t > 1).then(|| {
                Tensor::ones([t, start + t], (Kind::Bool, tch::Device::Cpu))
                    .triu(start + 1)
                    .view([1, 1, t, start + t])
            })
        })
        .collect()
}

/// What the decode pass of a step ([`Llama::decode_layers`]) runs on, held with Q8_0 weights
/// only: the matrices as Q8_0, and the norms' weights and RoPE tables as plain f32 (copies of
/// [`Llama`]'s tensors: 2 x context x head_dim values for the tables, 4 MiB at 8k positions).
struct Q8Decode {
    layers: Vec<Q8Layer>,
    output: Q8Matrix,
    out_norm: Vec<f32>,
    /// [`Llama`]'s `rope_cos` and `rope_sin`, row-major `[context, head_dim]`.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
}

/// One layer of [`Q8Decode`].
struct Q8Layer {
    /// The attention and feed-forward norms' weights.
    norms: [Vec<f32>; 2],
    wqkv: Q8Matrix,
    wo: Q8Matrix,
    w_gate_up: Q8Matrix,
    w_down: Q8Matrix,
}

impl Q8Decode {
    /// The RoPE cosines and signed sines of position `p` (`head_dim` each). Past the model's
    /// context it panics, as libtorch's lookup in [`Llama::layers_over`] does (the engine never
    /// gets there: it refuses sequences longer than the context).
    fn rope_row(&self, p: usize, head_dim: usize) -> (&[f32], &[f32]) {
        let at = p * head_dim..(p + 1) * head_dim;
        match (self.rope_cos.get(at.clone()), self.rope_sin.get(at)) {
            (Some(c), Some(s)) => (c, s),
            _ => panic!("position {p} is past the model's context"),
        }
    }
}

/// RMSNorm of each `w.len()`-wide row of `x`, times `w`.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let mean_sq = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / w.len() as f64;
        let scale = (1.0 / (mean_sq + eps).sqrt()) as f32;
        out.extend(row.iter().zip(w).map(|(&v, &w)| v * scale * w));
    }
    out
}

/// [`rope`] on one row of heads (`head_dim` values each) with that row's `cos` and `sin`.
fn rope_heads(heads: &mut [f32], cos: &[f32], sin: &[f32]) {
    for head in heads.chunks_exact_mut(cos.len()) {
        for ((pair, c), s) in head
            .chunks_exact_mut(2)
            .zip(cos.chunks_exact(2))
            .zip(sin.chunks_exact(2))
        {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * c[0] + b * s[0];
            pair[1] = b * c[1] + a * s[1];
        }
    }
}

/// SwiGLU of rows `[gate (ffn) | up (ffn)]`: `silu(gate) * up`, `ffn` values a row.
fn swiglu_rows(gu: &[f32], ffn: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(gu.len() / 2);
    for row in gu.chunks_exact(2 * ffn) {
        let (gate, up) = row.split_at(ffn);
        out.extend(
            gate.iter()
                .zip(up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u),
        );
    }
    out
}

/// `x += y`, elementwise.
fn add_rows(x: &mut [f32], y: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{
        f32_values, rms_norm_rows, rope, rope_heads, swiglu_rows, KvCache, LlamaConfig,
        OneTorchThread,
    };
    use tch::{Kind, Tensor};

    /// A model shape small enough to read a cache's values back by hand: 2 layers, 2 kv
    /// heads of 4 lanes (the cache tests here and in `crate::evict`).
    pub(crate) fn tiny_config() -> LlamaConfig {
        LlamaConfig {
            n_layer: 2,
            d_model: 8,
            n_head: 2,
            n_kv_head: 2,
            head_dim: 4,
            ffn: 8,
            context: 64,
            rope_base: 10_000.0,
            eps: 1e-5,
            vocab: 10,
        }
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The plain-f32 RMSNorm, RoPE and SwiGLU of a Q8_0 decode step compute what the libtorch
    /// ops of every other step do, row by row (a swapped pair or sign in RoPE, or a norm over
    /// the wrong width, would be off by far more than rounding).
    #[test]
    fn plain_row_ops_match_libtorch_ops() {
        let _guard = tch::no_grad_guard();
        tch::manual_seed(7);
        let f = (Kind::Float, tch::Device::Cpu);
        let (t, d, hd, heads) = (3i64, 96i64, 8i64, 12i64);
        let x = Tensor::randn([t, d], f) * 3.0;
        let w = Tensor::randn([d], f);
        let torch_norm = f32_values(&x.rms_norm([d], Some(&w), 1e-5));
        let norm = rms_norm_rows(&f32_values(&x), &f32_values(&w), 1e-5);
        assert!(max_diff(&norm, &torch_norm) < 1e-5);

        let angles = Tensor::rand([t, hd / 2], f) * 6.0;
        let cos = Tensor::stack(&[angles.cos(), angles.cos()], -1).view([t, hd]);
        let sin = Tensor::stack(&[-angles.sin(), angles.sin()], -1).view([t, hd]);
        let q = Tensor::randn([t, heads, hd], f);
        let torch_rope = f32_values(&rope(&q, &cos.unsqueeze(1), &sin.unsqueeze(1)));
        let mut ours = f32_values(&q);
        let (cos, sin) = (f32_values(&cos), f32_values(&sin));
        let hd = hd as usize;
        for (i, row) in ours.chunks_exact_mut(heads as usize * hd).enumerate() {
            rope_heads(row, &cos[i * hd..(i + 1) * hd], &sin[i * hd..(i + 1) * hd]);
        }
        assert!(max_diff(&ours, &torch_rope) < 1e-5);

        let ffn = 40i64;
        let gu = Tensor::randn([t, 2 * ffn], f) * 4.0;
        let torch_swiglu = f32_values(&(gu.narrow(1, 0, ffn).silu() * gu.narrow(1, ffn, ffn)));
        let swiglu = swiglu_rows(&f32_values(&gu), ffn as usize);
        assert!(max_diff(&swiglu, &torch_swiglu) < 1e-5);
    }

    /// Keys lie as `[kv heads, head_dim, capacity]` under their `[kv heads, capacity,
    /// head_dim]` view, also once the cache has grown or evicted slots (each builds new
    /// buffers), so the scores' product reads them in place; values keep the plain layout; and
    /// what was written reads back unchanged through every rebuild.
    #[test]
    fn keys_lie_transposed_under_their_view_through_every_rebuild() {
        let _guard = tch::no_grad_guard();
        let cfg = tiny_config();
        let (kvh, hd) = (2i64, 4i64);
        let laid_out = |kv: &KvCache| {
            let cap = kv.capacity as i64;
            assert_eq!(kv.k[0].size(), [kvh, cap, hd]);
            assert_eq!(kv.k[0].stride(), [hd * cap, 1, cap], "keys");
            assert_eq!(kv.v[0].stride(), [cap * hd, hd, 1], "values");
        };
        let held = |kv: &KvCache| {
            let len = kv.len as i64;
            (
                f32_values(&kv.k[0].narrow(1, 0, len)),
                f32_values(&kv.v[0].narrow(1, 0, len)),
            )
        };
        // Capacities 5, 9, 3 and 2: never `head_dim`, where a buffer with its last two
        // dimensions swapped would show the same strides. Keys and values hold different values.
        let mut kv = KvCache::new(&cfg, 5);
        laid_out(&kv);
        let keys = Tensor::arange(kvh * 4 * hd, (Kind::Float, tch::Device::Cpu)).view([kvh, 4, hd]);
        let vals = -&keys - 1.0;
        kv.k[0].narrow(1, 0, 4).copy_(&keys);
        kv.v[0].narrow(1, 0, 4).copy_(&vals);
        kv.advance(4);
        let both = |f: &dyn Fn(&Tensor) -> Tensor| (f32_values(&f(&keys)), f32_values(&f(&vals)));
        assert_eq!(held(&kv), both(&|t| t.shallow_clone()));

        kv.reserve(&cfg, 9);
        laid_out(&kv);
        assert_eq!(held(&kv), both(&|t| t.shallow_clone()));

        kv.retain(&cfg, &[1, 3], 1);
        laid_out(&kv);
        let slots = Tensor::from_slice(&[1i64, 3]);
        assert_eq!(held(&kv), both(&|t| t.index_select(1, &slots)));

        // Head 0 keeps its slot 0 (position 1), head 1 its slot 1 (position 3).
        kv.retain_per_head(&cfg, &[Tensor::from_slice(&[0i64, 1]).view([2, 1])], 1);
        laid_out(&kv);
        let per_head = |t: &Tensor| Tensor::stack(&[t.get(0).get(1), t.get(1).get(3)], 0);
        assert_eq!(held(&kv), both(&per_head));
    }

    /// The guard of a Q8_0 decode step holds libtorch at one thread and gives the count back
    /// when dropped, also when the step panics (the worker catches a failed step and goes on).
    #[test]
    fn one_torch_thread_gives_the_count_back_even_when_the_step_panics() {
        tch::set_num_threads(2);
        {
            let _one = OneTorchThread::hold();
            assert_eq!(tch::get_num_threads(), 1);
        }
        assert_eq!(tch::get_num_threads(), 2);
        let failed = std::panic::catch_unwind(|| {
            let _one = OneTorchThread::hold();
            panic!("a step that failed");
        });
        assert!(failed.is_err());
        assert_eq!(tch::get_num_threads(), 2);
    }
}
