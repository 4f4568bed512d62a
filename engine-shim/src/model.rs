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
}

impl WeightType {
    /// The name used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for WeightType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WeightType::F32),
            "bf16" => Ok(WeightType::Bf16),
            other => Err(format!("{other:?}: use f32 or bf16")),
        }
    }
}

/// A weight matrix `W` (`[out, in]`) held as `W^T` (`[in, out]`) in f32 or bf16, applied to
/// f32 rows as `x W^T`.
struct Linear {
    wt: Tensor,
    kind: Kind,
}

impl Linear {
    fn new(w: Tensor, kind: Kind) -> Linear {
        Linear {
            wt: w.tr().contiguous().to_kind(kind),
            kind,
        }
    }

    /// `x` (f32 rows) times this weight, in f32.
    fn apply(&self, x: &Tensor) -> Tensor {
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
    /// cos/sin of RoPE angles for every position, `[context, head_dim / 2]`.
    rope_cos: Tensor,
    rope_sin: Tensor,
}

/// The key/value cache of one sequence: per layer `[n_kv_head, capacity, head_dim]`, grown by
/// [`KvCache::reserve`] (a copy into a larger buffer) as the sequence lengthens.
pub struct KvCache {
    /// Keys per layer.
    pub k: Vec<Tensor>,
    /// Values per layer.
    pub v: Vec<Tensor>,
    /// Positions filled.
    pub len: usize,
    /// Positions available.
    pub capacity: usize,
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
        }
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
        self.capacity = capacity;
    }
}

fn kv_buffer(cfg: &LlamaConfig, capacity: usize) -> Tensor {
    Tensor::zeros(
        [cfg.n_kv_head as i64, capacity as i64, cfg.head_dim as i64],
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

/// The matrices `names` (each `[rows_i, cols]`) stacked by rows, held as `kind`.
fn stacked(
    g: &Gguf,
    names: &[String],
    rows: &[i64],
    cols: i64,
    kind: Kind,
) -> Result<Linear, ModelError> {
    let mut ws = Vec::with_capacity(names.len());
    for (name, &r) in names.iter().zip(rows) {
        ws.push(weight(g, name, &[r, cols])?);
    }
    Ok(Linear::new(Tensor::cat(&ws, 0), kind))
}

/// RoPE on `x` `[T, heads, head_dim]` with per-row `cos`/`sin` `[T, 1, head_dim / 2]`, rotating
/// adjacent pairs (2i, 2i+1) as GGML does for Llama GGUFs.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (t, h, hd) = x.size3().unwrap_or((0, 0, 0));
    let pairs = x.view([t, h, hd / 2, 2]);
    let x0 = pairs.select(-1, 0);
    let x1 = pairs.select(-1, 1);
    let r0 = &x0 * cos - &x1 * sin;
    let r1 = &x0 * sin + &x1 * cos;
    Tensor::stack(&[r0, r1], -1).view([t, h, hd])
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
        let kind = match weights {
            WeightType::F32 => Kind::Float,
            WeightType::Bf16 => Kind::BFloat16,
        };
        let output = Linear::new(out_w, kind);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: weight(g, &n("attn_norm"), &[d])?,
                wqkv: stacked(
                    g,
                    &[n("attn_q"), n("attn_k"), n("attn_v")],
                    &[d, kvd, kvd],
                    d,
                    kind,
                )?,
                wo: stacked(g, &[n("attn_output")], &[d], d, kind)?,
                ffn_norm: weight(g, &n("ffn_norm"), &[d])?,
                w_gate_up: stacked(g, &[n("ffn_gate"), n("ffn_up")], &[f, f], d, kind)?,
                w_down: stacked(g, &[n("ffn_down")], &[d], f, kind)?,
            });
        }
        let half = (head_dim / 2) as i64;
        let inv_freq = Tensor::arange(half, (Kind::Float, tch::Device::Cpu))
            .g_mul_scalar(-2.0 / head_dim as f64)
            .exp2()
            .pow_tensor_scalar(cfg.rope_base.log2());
        let pos = Tensor::arange(cfg.context as i64, (Kind::Float, tch::Device::Cpu));
        let angles = pos.unsqueeze(1) * inv_freq.unsqueeze(0);
        Ok(Llama {
            out_norm: weight(g, "output_norm.weight", &[d])?,
            output,
            rope_cos: angles.cos(),
            rope_sin: angles.sin(),
            embd,
            layers,
            cfg,
        })
    }

    fn norm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        x.rms_norm([self.cfg.d_model as i64], Some(w), self.cfg.eps)
    }

    /// Appends `tokens` to the sequence in `cache` and returns the logits `[T, vocab]` of every
    /// new position (`last_only`: of the last one only, `[1, vocab]`). The cache grows as needed.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, last_only: bool) -> Tensor {
        cache.reserve(&self.cfg, cache.len + tokens.len());
        let x = self.layers_over(&mut [Chunk {
            tokens,
            kv: cache,
            logits: true,
        }]);
        let t = tokens.len() as i64;
        let x = if last_only { x.narrow(0, t - 1, 1) } else { x };
        let logits = self.output.apply(&self.norm(&x, &self.out_norm));
        cache.len += tokens.len();
        logits
    }

    /// One batched step: appends each chunk's tokens to its sequence, and returns the logits
    /// (`[n, vocab]`) of the last token of each chunk that wants them, in order. Every cache must
    /// have room ([`KvCache::reserve`]); caches are advanced only once the whole step is done.
    pub fn forward_batch(&self, chunks: &mut [Chunk<'_>]) -> Tensor {
        let mut rows = Vec::new();
        let mut at = 0i64;
        for c in chunks.iter() {
            at += c.tokens.len() as i64;
            if c.logits {
                rows.push(at - 1);
            }
        }
        let x = self.layers_over(chunks);
        let x = x.index_select(0, &Tensor::from_slice(&rows));
        let logits = self.output.apply(&self.norm(&x, &self.out_norm));
        // Only now: a step that failed anywhere above left every cache as it was.
        for ch in chunks.iter_mut() {
            ch.kv.len += ch.tokens.len();
        }
        logits
    }

    /// The transformer over every chunk's tokens (their K and V written after each cache's
    /// `len`, which the caller advances); returns the final hidden states `[T, d]`.
    fn layers_over(&self, chunks: &mut [Chunk<'_>]) -> Tensor {
        let c = &self.cfg;
        let (h, kvh, hd) = (c.n_head as i64, c.n_kv_head as i64, c.head_dim as i64);
        let (d, kvd) = (c.d_model as i64, kvh * hd);
        let group = h / kvh;
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        for ch in chunks.iter() {
            let start = ch.kv.len as i64;
            ids.extend(ch.tokens.iter().map(|&x| x as i64));
            pos.extend(start..start + ch.tokens.len() as i64);
        }
        let t_all = ids.len() as i64;
        let mut x = self.embd.index_select(0, &Tensor::from_slice(&ids));
        let pos = Tensor::from_slice(&pos);
        let cos = self.rope_cos.index_select(0, &pos).unsqueeze(1);
        let sin = self.rope_sin.index_select(0, &pos).unsqueeze(1);
        // Prefill chunks attend causally: query i (position start+i) sees keys 0..=start+i.
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
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            let hn = self.norm(&x, &l.attn_norm);
            let qkv = l.wqkv.apply(&hn);
            let q = rope(&qkv.narrow(1, 0, d).reshape([t_all, h, hd]), &cos, &sin);
            let k = rope(&qkv.narrow(1, d, kvd).reshape([t_all, kvh, hd]), &cos, &sin);
            let v = qkv.narrow(1, d + kvd, kvd).reshape([t_all, kvh, hd]);
            let mut outs = Vec::with_capacity(chunks.len());
            let mut off = 0i64;
            for (ch, mask) in chunks.iter_mut().zip(&masks) {
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
                let scores = qg.bmm(&keys.transpose(1, 2)) * scale;
                let scores = match mask {
                    Some(m) => scores
                        .view([kvh, group, t, total])
                        .masked_fill(m, f64::NEG_INFINITY)
                        .view([kvh, group * t, total]),
                    None => scores,
                };
                let out = scores
                    .softmax(-1, Kind::Float)
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
            x += l.wo.apply(&attn);
            let hn = self.norm(&x, &l.ffn_norm);
            let gu = l.w_gate_up.apply(&hn);
            let f = c.ffn as i64;
            let ff = gu.narrow(1, 0, f).silu() * gu.narrow(1, f, f);
            x += l.w_down.apply(&ff);
        }
        x
    }
}
