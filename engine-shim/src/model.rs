//! The Llama forward pass on libtorch: RMSNorm, grouped-query attention, RoPE in GGML's
//! adjacent-pair ("normal") form, SwiGLU, tied output embedding when the file has no
//! `output.weight`. The residual stream, norms and softmax are f32; the matrix weights are held
//! as [`WeightType`] says. Q, K and V are one matrix, gate and up another, so a layer is four
//! matrix products whatever the batch.
//!
//! Each sequence's KV lives in its own [`KvCache`], one buffer per layer that grows as the
//! sequence does. [`Llama::forward_batch`] runs one step over several sequences at once: their
//! new tokens (a decode token each, or a prefill chunk) are stacked into one matrix for every
//! product, and only attention runs per sequence (each over its own cache).

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
    /// Context length the model was trained for.
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

/// candle's repacked x86 kernels need the inner dimension in whole 256-value superblocks.
const Q8_K_MULTIPLE: usize = 256;

/// A weight matrix `W` (`[out, in]`) applied to f32 rows as `x W^T`.
struct Linear {
    /// `W^T` (`[in, out]`) in f32 or bf16, for libtorch's GEMM.
    wt: Tensor,
    kind: Kind,
    /// `W` as Q8_0 with `in` zero-padded to `k_pad`, for decode rows.
    q8: Option<Q8Matrix>,
}

/// Which rows of a step are decode tokens (the Q8_0 path in `q8_0` mode).
enum Rows {
    /// Every row.
    Decode,
    /// None.
    Prompt,
    /// Some: the indices of each kind.
    Mixed { decode: Tensor, prompt: Tensor },
}

impl Rows {
    /// From one flag per row (`true`: a decode token).
    fn from_flags(decode: impl Iterator<Item = bool>) -> Rows {
        let (mut d, mut p) = (Vec::new(), Vec::new());
        for (i, is_decode) in decode.enumerate() {
            if is_decode { &mut d } else { &mut p }.push(i as i64);
        }
        match (d.is_empty(), p.is_empty()) {
            (false, true) => Rows::Decode,
            (true, _) => Rows::Prompt,
            (false, false) => Rows::Mixed {
                decode: Tensor::from_slice(&d),
                prompt: Tensor::from_slice(&p),
            },
        }
    }
}

/// Holds libtorch at one intra-op thread while it lives (a step of Q8_0 decode rows only), and
/// gives back the count it found when dropped, unwinding included.
///
/// In such a step libtorch runs only small ops (norms, RoPE, attention over one sequence's
/// cache), whose OpenMP fan-out costs more than it gains, while candle's pool, which runs the
/// matrix products, keeps a worker spinning on the other core between them. Measured with
/// `decode_step` (256-token context, 2 cores): 12.4-12.5 ms a step against 13.5-13.7 with two
/// threads, and 43.1-43.4 against 47.6-49.7 ms at 8 sequences. Steps with prompt rows keep
/// every thread: their f32 GEMMs need them.
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

struct Q8Matrix {
    m: QMatMul,
    k: usize,
    k_pad: usize,
    n: usize,
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
        Ok(Q8Matrix { m: q, k, k_pad, n })
    }

    /// `x` (`[t, k]` f32) times `W^T`.
    fn apply(&self, x: &Tensor) -> Tensor {
        let t = x.size()[0] as usize;
        let rows = Vec::<f32>::try_from(x.contiguous().view([-1]))
            .unwrap_or_else(|e| panic!("Q8_0 input: {e}"));
        let mut buf = vec![0f32; t * self.k_pad];
        for (dst, src) in buf.chunks_mut(self.k_pad).zip(rows.chunks(self.k)) {
            dst[..self.k].copy_from_slice(src);
        }
        let out = candle_core::Tensor::from_vec(buf, (t, self.k_pad), &candle_core::Device::Cpu)
            .and_then(|xt| self.m.forward(&xt))
            .and_then(|y| y.flatten_all())
            .and_then(|y| y.to_vec1::<f32>())
            .unwrap_or_else(|e| q8_failed(e));
        Tensor::from_slice(&out).view([t as i64, self.n as i64])
    }
}

impl Linear {
    fn new(w: Tensor, weights: WeightType) -> Result<Linear, ModelError> {
        let kind = match weights {
            WeightType::Bf16 => Kind::BFloat16,
            WeightType::F32 | WeightType::Q8_0 => Kind::Float,
        };
        let q8 = match weights {
            WeightType::Q8_0 => Some(Q8Matrix::new(&w)?),
            _ => None,
        };
        Ok(Linear {
            wt: w.tr().contiguous().to_kind(kind),
            kind,
            q8,
        })
    }

    /// `x` (f32 rows) times this weight, in f32: decode rows through Q8_0 when held.
    fn apply(&self, x: &Tensor, rows: &Rows) -> Tensor {
        let Some(q8) = &self.q8 else {
            return self.dense(x);
        };
        match rows {
            Rows::Decode => q8.apply(x),
            Rows::Prompt => self.dense(x),
            Rows::Mixed { decode, prompt } => {
                let d = q8.apply(&x.index_select(0, decode));
                let p = self.dense(&x.index_select(0, prompt));
                let mut out = Tensor::empty([x.size()[0], q8.n as i64], (Kind::Float, x.device()));
                let _ = out.index_copy_(0, decode, &d);
                let _ = out.index_copy_(0, prompt, &p);
                out
            }
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
}

/// The key/value cache of one sequence: per layer `[n_kv_head, capacity, head_dim]`, grown by
/// [`KvCache::reserve`] (a copy into a larger buffer) as the sequence lengthens.
///
/// Keys are stored after RoPE, so a slot keeps its token's original position whatever is
/// evicted around it (`crate::evict`): slots are filled in position order, and eviction keeps
/// that order, but once anything is evicted slot `i` no longer holds position `i` (`len` slots
/// held, `pos` tokens appended).
pub struct KvCache {
    /// Keys per layer.
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
        let make = || (0..cfg.n_layer).map(|_| kv_buffer(cfg, capacity)).collect();
        KvCache {
            k: make(),
            v: make(),
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
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let bigger = kv_buffer(cfg, capacity);
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

    /// Keeps only the slots `keep` (ascending, each below `len`), in every layer and head, in
    /// new buffers of `keep.len() + headroom` slots: the memory of what is dropped is freed.
    pub fn retain(&mut self, cfg: &LlamaConfig, keep: &[usize], headroom: usize) {
        let idx = Tensor::from_slice(&keep.iter().map(|&i| i as i64).collect::<Vec<_>>());
        let n = keep.len() as i64;
        let capacity = keep.len() + headroom;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            let smaller = kv_buffer(cfg, capacity);
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
            for t in [&mut self.k[layer], &mut self.v[layer]] {
                let smaller = kv_buffer(cfg, capacity);
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

fn kv_buffer(cfg: &LlamaConfig, capacity: usize) -> Tensor {
    Tensor::zeros(
        [cfg.n_kv_head as i64, capacity as i64, cfg.head_dim as i64],
        (Kind::Float, tch::Device::Cpu),
    )
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

/// The matrices `names` (each `[rows_i, cols]`, multiplied by `factors_i`) stacked by rows,
/// held as `weights` says.
fn stacked(
    g: &Gguf,
    names: &[String],
    rows: &[i64],
    factors: &[f64],
    cols: i64,
    weights: WeightType,
) -> Result<Linear, ModelError> {
    let mut ws = Vec::with_capacity(names.len());
    for ((name, &r), &factor) in names.iter().zip(rows).zip(factors) {
        let w = weight(g, name, &[r, cols])?;
        ws.push(if factor == 1.0 { w } else { w * factor });
    }
    Linear::new(Tensor::cat(&ws, 0), weights)
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
        if n_head == 0
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
        let cfg = LlamaConfig {
            n_layer: u("block_count")?,
            d_model,
            n_head,
            n_kv_head,
            head_dim,
            ffn,
            context: u("context_length")?,
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
        let output = Linear::new(out_w, weights)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: weight(g, &n("attn_norm"), &[d])?,
                wqkv: stacked(
                    g,
                    &[n("attn_q"), n("attn_k"), n("attn_v")],
                    &[d, kvd, kvd],
                    // Attention's 1/sqrt(head_dim) folded into Q (RoPE is linear): one op
                    // less per layer, and exact for power-of-two head widths.
                    &[1.0 / (head_dim as f64).sqrt(), 1.0, 1.0],
                    d,
                    weights,
                )?,
                wo: stacked(g, &[n("attn_output")], &[d], &[1.0], d, weights)?,
                ffn_norm: weight(g, &n("ffn_norm"), &[d])?,
                w_gate_up: stacked(
                    g,
                    &[n("ffn_gate"), n("ffn_up")],
                    &[f, f],
                    &[1.0, 1.0],
                    d,
                    weights,
                )?,
                w_down: stacked(g, &[n("ffn_down")], &[d], &[1.0], f, weights)?,
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
        Ok(Llama {
            out_norm: weight(g, "output_norm.weight", &[d])?,
            output,
            rope_cos: Tensor::stack(&[angles.cos(), angles.cos()], -1).view([ctx, hd]),
            rope_sin: Tensor::stack(&[-angles.sin(), angles.sin()], -1).view([ctx, hd]),
            embd,
            layers,
            cfg,
        })
    }

    /// The kinds of a step's rows, from one flag per row (`true`: a decode token); without
    /// Q8_0 matrices every row takes the one path, and nothing is indexed.
    fn rows(&self, decode: impl Iterator<Item = bool>) -> Rows {
        if self.output.q8.is_none() {
            return Rows::Prompt;
        }
        Rows::from_flags(decode)
    }

    /// Whether a step of these chunks (one flag each: a decode token) runs only Q8_0 decode
    /// rows, for [`OneTorchThread`].
    fn q8_decode_only(&self, decode: impl IntoIterator<Item = bool>) -> bool {
        self.output.q8.is_some() && decode.into_iter().all(|d| d)
    }

    fn norm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.rms_norm([self.cfg.d_model as i64], Some(w), self.cfg.eps)
    }

    /// Appends `tokens` to the sequence in `cache` and returns the logits `[T, vocab]` of every
    /// new position (`last_only`: of the last one only, `[1, vocab]`). The cache grows as needed.
    /// One token counts as a decode token ([`Chunk::decode`]), more as prompt.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, last_only: bool) -> Tensor {
        cache.reserve(&self.cfg, cache.len + tokens.len());
        let decode = tokens.len() == 1;
        let _threads = self.q8_decode_only([decode]).then(OneTorchThread::hold);
        let (x, attention) = self.layers_over(&mut [Chunk {
            tokens,
            kv: cache,
            logits: true,
            decode,
        }]);
        let t = tokens.len() as i64;
        let x = if last_only { x.narrow(0, t - 1, 1) } else { x };
        let rows = self.rows(std::iter::repeat_n(decode, x.size()[0] as usize));
        let logits = self.output.apply(&self.norm(&x, &self.out_norm), &rows);
        for (layer, a) in attention.into_iter().flatten() {
            cache.add_attention(layer, &a);
        }
        cache.advance(tokens.len());
        logits
    }

    /// One batched step: appends each chunk's tokens to its sequence, and returns the logits
    /// (`[n, vocab]`) of the last token of each chunk that wants them, in order. Every cache must
    /// have room ([`KvCache::reserve`]); caches are advanced only once the whole step is done.
    pub fn forward_batch(&self, chunks: &mut [Chunk<'_>]) -> Tensor {
        let _threads = self
            .q8_decode_only(chunks.iter().map(|c| c.decode))
            .then(OneTorchThread::hold);
        let mut rows = Vec::new();
        let mut at = 0i64;
        for c in chunks.iter() {
            at += c.tokens.len() as i64;
            if c.logits {
                rows.push(at - 1);
            }
        }
        let (x, attention) = self.layers_over(chunks);
        let x = x.index_select(0, &Tensor::from_slice(&rows));
        let kinds = self.rows(chunks.iter().filter(|c| c.logits).map(|c| c.decode));
        let logits = self.output.apply(&self.norm(&x, &self.out_norm), &kinds);
        // Only now: a step that failed anywhere above left every cache as it was (a retried
        // chunk does not count its attention twice).
        for (ch, attention) in chunks.iter_mut().zip(attention) {
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
    fn layers_over(&self, chunks: &mut [Chunk<'_>]) -> (Tensor, Vec<Vec<(usize, Tensor)>>) {
        let c = &self.cfg;
        let (h, kvh, hd) = (c.n_head as i64, c.n_kv_head as i64, c.head_dim as i64);
        let (d, kvd) = (c.d_model as i64, kvh * hd);
        let group = h / kvh;
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        for ch in chunks.iter() {
            let start = ch.kv.pos as i64;
            ids.extend(ch.tokens.iter().map(|&x| x as i64));
            pos.extend(start..start + ch.tokens.len() as i64);
        }
        let t_all = ids.len() as i64;
        let rows = self.rows(
            chunks
                .iter()
                .flat_map(|ch| std::iter::repeat_n(ch.decode, ch.tokens.len())),
        );
        let mut x = self.embd.index_select(0, &Tensor::from_slice(&ids));
        let pos = Tensor::from_slice(&pos);
        let cos = self.rope_cos.index_select(0, &pos).unsqueeze(1);
        let sin = self.rope_sin.index_select(0, &pos).unsqueeze(1);
        // Prefill chunks attend causally: query i sees every held slot and the chunk's keys
        // 0..=i (held slots are all earlier positions).
        let masks: Vec<Option<Tensor>> = chunks
            .iter()
            .map(|ch| {
                let (t, start) = (ch.tokens.len() as i64, ch.kv.len as i64);
                (t > 1).then(|| {
                    Tensor::ones([t, start + t], (Kind::Bool, tch::Device::Cpu))
                        .triu(start + 1)
                        .view([1, 1, t, start + t])
                })
            })
            .collect();
        let mut attention: Vec<Vec<(usize, Tensor)>> = chunks.iter().map(|_| Vec::new()).collect();
        for (li, l) in self.layers.iter().enumerate() {
            let hn = self.norm(&x, &l.attn_norm);
            let qkv = l.wqkv.apply(&hn, &rows);
            // Q (already scaled by 1/sqrt(head_dim)) and K rotated together.
            let qk = rope(
                &qkv.narrow(1, 0, d + kvd).reshape([t_all, h + kvh, hd]),
                &cos,
                &sin,
            );
            let q = qk.narrow(1, 0, h);
            let k = qk.narrow(1, h, kvh);
            let v = qkv.narrow(1, d + kvd, kvd).reshape([t_all, kvh, hd]);
            let mut outs = Vec::with_capacity(chunks.len());
            let mut off = 0i64;
            for ((ch, mask), received) in chunks.iter_mut().zip(&masks).zip(&mut attention) {
                let t = ch.tokens.len() as i64;
                let start = ch.kv.len as i64;
                let total = start + t;
                ch.kv.k[li]
                    .narrow(1, start, t)
                    .copy_(&k.narrow(0, off, t).transpose(0, 1));
                ch.kv.v[li]
                    .narrow(1, start, t)
                    .copy_(&v.narrow(0, off, t).transpose(0, 1));
                // Batched over kv heads, with each kv head's `group` query heads stacked as
                // rows: no broadcast, so the cached keys and values are read in place.
                let keys = ch.kv.k[li].narrow(1, 0, total); // [kvh, total, hd]
                let vals = ch.kv.v[li].narrow(1, 0, total);
                let qg =
                    q.narrow(0, off, t)
                        .transpose(0, 1)
                        .contiguous()
                        .view([kvh, group * t, hd]);
                let scores = qg.bmm(&keys.transpose(1, 2));
                let scores = match mask {
                    Some(m) => scores
                        .view([kvh, group, t, total])
                        .masked_fill(m, f64::NEG_INFINITY)
                        .view([kvh, group * t, total]),
                    None => scores,
                };
                let probs = scores.softmax(-1, Kind::Float);
                if ch.kv.attention.is_some() {
                    received.push((
                        li,
                        probs.sum_dim_intlist([1i64].as_slice(), false, Kind::Float),
                    ));
                }
                let out = probs
                    .bmm(&vals)
                    .view([h, t, hd])
                    .transpose(0, 1)
                    .reshape([t, h * hd]);
                outs.push(out);
                off += t;
            }
            let attn = if outs.len() == 1 {
                outs.remove(0)
            } else {
                Tensor::cat(&outs, 0)
            };
            x += l.wo.apply(&attn, &rows);
            let hn = self.norm(&x, &l.ffn_norm);
            let gu = l.w_gate_up.apply(&hn, &rows);
            let f = c.ffn as i64;
            let ff = gu.narrow(1, 0, f).silu() * gu.narrow(1, f, f);
            x += l.w_down.apply(&ff, &rows);
        }
        (x, attention)
    }
}

#[cfg(test)]
mod tests {
    use super::OneTorchThread;

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
