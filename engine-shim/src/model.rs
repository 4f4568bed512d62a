//! The Llama forward pass on libtorch, in f32: RMSNorm, grouped-query attention, RoPE in GGML's
//! adjacent-pair ("normal") form, SwiGLU, tied output embedding when the file has no
//! `output.weight`. Weights are dequantised once at load.
//!
//! The KV of the sequence being computed lives in [`KvCache`], one contiguous buffer per layer;
//! [`Llama::forward`] appends a chunk of tokens to it (chunked prefill calls it once per chunk).

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
    /// Context length the model was trained for.
    pub context: usize,
    /// RoPE base.
    pub rope_base: f64,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Vocabulary size.
    pub vocab: usize,
}

struct Layer {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
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

/// A loaded model.
pub struct Llama {
    /// Hyperparameters.
    pub cfg: LlamaConfig,
    kind: Kind,
    embd: Tensor,
    output: Tensor,
    out_norm: Tensor,
    layers: Vec<Layer>,
    /// cos/sin of RoPE angles for every position, `[context, head_dim / 2]`.
    rope_cos: Tensor,
    rope_sin: Tensor,
}

/// The key/value cache of one sequence: per layer `[n_kv_head, capacity, head_dim]`.
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
        let shape = [cfg.n_kv_head as i64, capacity as i64, cfg.head_dim as i64];
        let make = || {
            (0..cfg.n_layer)
                .map(|_| Tensor::zeros(shape, (Kind::Float, tch::Device::Cpu)))
                .collect()
        };
        KvCache {
            k: make(),
            v: make(),
            len: 0,
            capacity,
        }
    }
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

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

impl Llama {
    /// Loads a Llama-architecture GGUF (weights dequantised to f32, then held as `weights`).
    pub fn load(g: &Gguf, weights: WeightType) -> Result<Self, ModelError> {
        let kind = match weights {
            WeightType::F32 => Kind::Float,
            WeightType::Bf16 => Kind::BFloat16,
        };
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Architecture(arch.to_string()));
        }
        let u = |k: &str| g.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let d_model = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = u("attention.head_count_kv")?;
        let ffn = u("feed_forward_length")?;
        if n_head == 0 || n_kv_head == 0 || d_model % n_head != 0 || n_head % n_kv_head != 0 {
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
            context: u("context_length")?,
            rope_base: g.get_f64("llama.rope.freq_base").unwrap_or(10_000.0),
            eps: g.get_f64("llama.attention.layer_norm_rms_epsilon")?,
            vocab,
        };
        let (d, kvd, f) = (d_model as i64, (n_kv_head * head_dim) as i64, ffn as i64);
        let embd = weight(g, "token_embd.weight", &[vocab as i64, d])?;
        // Tied embeddings when there is no separate output matrix.
        let output = if g.tensors.contains_key("output.weight") {
            weight(g, "output.weight", &[vocab as i64, d])?
        } else {
            embd.shallow_clone()
        };
        let t = |w: Tensor| w.tr().contiguous().to_kind(kind);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: weight(g, &n("attn_norm"), &[d])?,
                wq: t(weight(g, &n("attn_q"), &[d, d])?),
                wk: t(weight(g, &n("attn_k"), &[kvd, d])?),
                wv: t(weight(g, &n("attn_v"), &[kvd, d])?),
                wo: t(weight(g, &n("attn_output"), &[d, d])?),
                ffn_norm: weight(g, &n("ffn_norm"), &[d])?,
                w_gate: t(weight(g, &n("ffn_gate"), &[f, d])?),
                w_up: t(weight(g, &n("ffn_up"), &[f, d])?),
                w_down: t(weight(g, &n("ffn_down"), &[d, f])?),
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
            output: output.tr().contiguous().to_kind(kind),
            kind,
            rope_cos: angles.cos(),
            rope_sin: angles.sin(),
            embd,
            layers,
            cfg,
        })
    }

    /// `x` (f32) times a weight held as `self.kind`, back in f32.
    fn mm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        if self.kind == Kind::Float {
            x.matmul(w)
        } else {
            x.to_kind(self.kind).matmul(w).to_kind(Kind::Float)
        }
    }

    /// RoPE on `x` `[T, heads, head_dim]` for positions `start..start+T`, rotating adjacent
    /// pairs (2i, 2i+1) as GGML does for Llama GGUFs.
    fn rope(&self, x: &Tensor, start: usize) -> Tensor {
        let (t, h, hd) = x.size3().unwrap_or((0, 0, 0));
        let cos = self.rope_cos.narrow(0, start as i64, t).unsqueeze(1);
        let sin = self.rope_sin.narrow(0, start as i64, t).unsqueeze(1);
        let pairs = x.view([t, h, hd / 2, 2]);
        let x0 = pairs.select(-1, 0);
        let x1 = pairs.select(-1, 1);
        let r0 = &x0 * &cos - &x1 * &sin;
        let r1 = &x0 * &sin + &x1 * &cos;
        Tensor::stack(&[r0, r1], -1).view([t, h, hd])
    }

    /// Appends `tokens` to the sequence in `cache` and returns the logits `[T, vocab]` of every
    /// new position (`last_only`: of the last one only, `[1, vocab]`).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, last_only: bool) -> Tensor {
        let c = &self.cfg;
        let t = tokens.len() as i64;
        let start = cache.len;
        let (h, kvh, hd) = (c.n_head as i64, c.n_kv_head as i64, c.head_dim as i64);
        let group = h / kvh;
        let ids: Vec<i64> = tokens.iter().map(|&x| x as i64).collect();
        let mut x = self.embd.index_select(0, &Tensor::from_slice(&ids));
        let total = start as i64 + t;
        // Query i (position start+i) may see keys 0..=start+i.
        let mask = Tensor::ones([t, total], (Kind::Bool, tch::Device::Cpu))
            .triu(start as i64 + 1)
            .view([1, 1, t, total]);
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            let hn = rms_norm(&x, &l.attn_norm, c.eps);
            let q = self.rope(&self.mm(&hn, &l.wq).view([t, h, hd]), start);
            let k = self.rope(&self.mm(&hn, &l.wk).view([t, kvh, hd]), start);
            let v = self.mm(&hn, &l.wv).view([t, kvh, hd]);
            cache.k[li]
                .narrow(1, start as i64, t)
                .copy_(&k.transpose(0, 1));
            cache.v[li]
                .narrow(1, start as i64, t)
                .copy_(&v.transpose(0, 1));
            // Batched over kv heads, with each kv head's `group` query heads stacked as rows:
            // no broadcast, so the cached keys and values are read in place, never copied.
            let keys = cache.k[li].narrow(1, 0, total); // [kvh, total, hd]
            let vals = cache.v[li].narrow(1, 0, total);
            let qg = q.transpose(0, 1).contiguous().view([kvh, group * t, hd]);
            let scores = (qg.bmm(&keys.transpose(1, 2)) * scale).view([kvh, group, t, total]);
            let probs = scores
                .masked_fill(&mask, f64::NEG_INFINITY)
                .softmax(-1, Kind::Float)
                .view([kvh, group * t, total]);
            let out = probs
                .bmm(&vals)
                .view([h, t, hd])
                .transpose(0, 1)
                .reshape([t, h * hd]);
            x += self.mm(&out, &l.wo);
            let hn = rms_norm(&x, &l.ffn_norm, c.eps);
            let ff = self.mm(
                &(self.mm(&hn, &l.w_gate).silu() * self.mm(&hn, &l.w_up)),
                &l.w_down,
            );
            x += ff;
        }
        cache.len = start + tokens.len();
        let x = if last_only { x.narrow(0, t - 1, 1) } else { x };
        self.mm(&rms_norm(&x, &self.out_norm, c.eps), &self.output)
    }
}
