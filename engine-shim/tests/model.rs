//! The model against an independent reference, and the tokenizer against the GGUF vocabulary.
//! Needs `scripts/setup.sh` (model in models/, reference venv in .venv-ref).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::OnceLock;

use engine_shim::gguf::Gguf;
use engine_shim::model::{Chunk, KvCache, Llama, WeightType};
use engine_shim::tokenizer::ModelTokenizer;
use tch::Tensor;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_path() -> PathBuf {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup.sh",
        p.display()
    );
    p
}

fn gguf() -> &'static Gguf {
    static G: OnceLock<Gguf> = OnceLock::new();
    G.get_or_init(|| Gguf::open(&model_path()).unwrap())
}

fn tok() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| ModelTokenizer::from_gguf(gguf()).unwrap())
}

fn vocab_id(token: &str) -> u32 {
    gguf()
        .get_strings("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .position(|t| *t == token)
        .unwrap_or_else(|| panic!("{token:?} not in the vocabulary")) as u32
}

fn france() -> Vec<u32> {
    let t = tok();
    let prompt = t
        .render_chat(&[("user".into(), "What is the capital of France?".into())])
        .unwrap();
    t.encode(&prompt).unwrap()
}

#[test]
fn dequantised_values_match_the_gguf_package() {
    // Values the `gguf` Python package gives for these tensors (../shared/SETUP.md).
    let (q, shape) = gguf().dequantize("blk.0.attn_q.weight").unwrap();
    assert_eq!(shape, vec![576, 576]);
    for (got, want) in q.iter().zip([-0.096313f32, 0.157349, -0.096313, -0.730469]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
    let (e, shape) = gguf().dequantize("token_embd.weight").unwrap();
    assert_eq!(shape, vec![49152, 576]);
    for (got, want) in e.iter().zip([-0.106544f32, 0.032978, 0.048199]) {
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
    }
}

#[test]
fn tokenizer_ids_follow_the_vocabulary() {
    let t = tok();
    // ChatML: control tokens are single ids; the default system prompt comes from the template.
    let ids = france();
    assert_eq!(ids.len(), 37);
    assert_eq!(ids[0], vocab_id("<|im_start|>"));
    assert_eq!(
        ids.iter().filter(|&&i| i == vocab_id("<|im_end|>")).count(),
        2
    );
    assert_eq!(t.eos, vocab_id("<|im_end|>"));
    // Whole words are their vocabulary entries; a leading space is byte-level "Ġ".
    assert_eq!(t.encode("Hello").unwrap(), vec![vocab_id("Hello")]);
    assert_eq!(
        t.encode("Hello world").unwrap(),
        vec![vocab_id("Hello"), vocab_id("Ġworld")]
    );
    // Digits are split one by one.
    let digits: Vec<u32> = "2026".chars().map(|c| vocab_id(&c.to_string())).collect();
    assert_eq!(t.encode("2026").unwrap(), digits);
    // Accents, CJK and emoji survive a round trip (byte-level BPE).
    for s in [
        "café naïve",
        "你好，世界",
        "🙂👍 ok",
        "<|im_start|>user\nx<|im_end|>",
    ] {
        let ids = t.encode(s).unwrap();
        assert!(!ids.is_empty());
        let back = t.decode(&ids).unwrap();
        let want = s.replace("<|im_start|>", "").replace("<|im_end|>", "");
        assert_eq!(back, want, "{s:?} -> {ids:?}");
    }
}

fn greedy(model: &Llama, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let _guard = tch::no_grad_guard();
    let mut cache = KvCache::new(&model.cfg, prompt.len() + n + 1);
    let mut logits = None;
    for c in prompt.chunks(chunk) {
        logits = Some(model.forward(c, &mut cache, true));
    }
    let mut out = Vec::new();
    let mut next = logits.unwrap().argmax(-1, false).int64_value(&[0]) as u32;
    for _ in 0..n {
        out.push(next);
        if next == tok().eos {
            break;
        }
        next = model
            .forward(&[next], &mut cache, true)
            .argmax(-1, false)
            .int64_value(&[0]) as u32;
    }
    out
}

#[test]
fn logits_match_an_independent_f32_reference_and_the_answer_is_paris() {
    check_against_reference(WeightType::F32);
}

/// bf16 weights stay correlated with the f32 reference; near-tied tokens may flip (Q4_1 weights
/// make near ties common), so the greedy answer is checked for f32 only.
#[test]
fn bf16_weights_still_match_the_f32_reference() {
    check_against_reference(WeightType::Bf16);
}

/// Q8_0 matrices (used for decode tokens, so the prompt goes in one token a step, which
/// `forward` counts as decode) stay correlated with the f32 reference and choose as it does up to
/// near ties, on the prompt and along their own greedy answer.
#[test]
fn q8_0_weights_match_the_f32_reference_token_by_token() {
    check_against_reference(WeightType::Q8_0);
}

/// With q8_0 a decode token's numbers do not depend on what shares its step: decoding beside
/// another sequence's prompt chunk (a mixed step, whose prompt rows go through f32) gives the
/// logits it gets alone, while the same token taken through f32 differs.
/// A chunk of `tokens` on `kv` that wants the logits of its last token; `decode` says whether
/// they are generated tokens.
fn wanting_logits<'a>(tokens: &'a [u32], kv: &'a mut KvCache, decode: bool) -> Chunk<'a> {
    Chunk {
        tokens,
        kv,
        logits: true,
        decode,
    }
}

/// A cache of `capacity` slots holding `prompt`, computed by `model`.
fn prefilled_cache(model: &Llama, prompt: &[u32], capacity: usize) -> KvCache {
    let mut kv = KvCache::new(&model.cfg, capacity);
    let _ = model.forward(prompt, &mut kv, true);
    kv
}

/// The largest difference between two tensors' values.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn q8_0_decode_rows_do_not_depend_on_what_shares_the_step() {
    let model = Llama::load(gguf(), WeightType::Q8_0).unwrap();
    let _guard = tch::no_grad_guard();
    let ids = france();
    let prefilled = || prefilled_cache(&model, &ids, ids.len() + 2);
    let next = [42u32];
    let step = |kv: &mut KvCache, decode: bool, beside: Option<&mut KvCache>| {
        let mut chunks = vec![wanting_logits(&next, kv, decode)];
        if let Some(other) = beside {
            chunks.push(wanting_logits(&ids, other, false));
        }
        model.forward_batch(&mut chunks).narrow(0, 0, 1)
    };
    let alone = step(&mut prefilled(), true, None);
    let mut other = KvCache::new(&model.cfg, ids.len());
    let mixed = step(&mut prefilled(), true, Some(&mut other));
    let as_prompt = step(&mut prefilled(), false, None);
    assert!(
        max_diff(&alone, &mixed) == 0.0,
        "mixed step moved the logits by {}",
        max_diff(&alone, &mixed)
    );
    assert!(
        max_diff(&alone, &as_prompt) > 1e-3,
        "the f32 path gave the Q8_0 logits"
    );
    // Such a step runs libtorch on one thread and gives the caller its count back, also when
    // it fails (a token libtorch cannot embed) and the engine goes on.
    tch::set_num_threads(2);
    let unknown = [u32::MAX];
    let mut kv = prefilled();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.forward_batch(&mut [wanting_logits(&unknown, &mut kv, true)])
    }));
    assert!(failed.is_err(), "an unknown token was embedded");
    assert_eq!(tch::get_num_threads(), 2);
    let _ = step(&mut kv, true, None);
    assert_eq!(tch::get_num_threads(), 2);
}

/// With q8_0, five sequences decoding in one step (candle's products over 5 rows: a tile of 4
/// and a single row; their attention shared out over the pool's threads) each get exactly the
/// logits they get alone.
#[test]
fn q8_0_decode_rows_of_five_sequences_are_each_exactly_their_own() {
    let model = Llama::load(gguf(), WeightType::Q8_0).unwrap();
    let _guard = tch::no_grad_guard();
    let ids = france();
    let next = [42u32];
    let prompts: Vec<&[u32]> = (0..5).map(|i| &ids[..ids.len() - 4 * i]).collect();
    let prefilled = |prompt: &[u32]| prefilled_cache(&model, prompt, ids.len() + 2);
    let mut caches: Vec<KvCache> = prompts.iter().map(|p| prefilled(p)).collect();
    let mut chunks: Vec<Chunk> = caches
        .iter_mut()
        .map(|kv| wanting_logits(&next, kv, true))
        .collect();
    let together = model.forward_batch(&mut chunks);
    assert_eq!(together.size(), [5, model.cfg.vocab as i64]);
    for (i, prompt) in prompts.iter().enumerate() {
        let alone = model.forward_batch(&mut [wanting_logits(&next, &mut prefilled(prompt), true)]);
        let moved = max_diff(&together.narrow(0, i as i64, 1), &alone);
        assert_eq!(moved, 0.0, "sequence {i} moved by {moved}");
    }
}

/// With q8_0 a step's decode chunks share their attention out over candle's pool threads. A
/// chunk whose attention fails there (a cache with no room left, which the engine never
/// builds) fails that step alone: no cache advances, and the next steps give what they give on
/// a pool that never saw a failure (one that unwound through candle's pool would poison the
/// lock every product takes).
#[test]
fn a_failing_attention_job_fails_its_step_and_the_pool_keeps_working() {
    let model = Llama::load(gguf(), WeightType::Q8_0).unwrap();
    let _guard = tch::no_grad_guard();
    let ids = france();
    let next = [42u32];
    let prefilled = |capacity: usize| prefilled_cache(&model, &ids, capacity);
    let step = |a: &mut KvCache, b: &mut KvCache| {
        model.forward_batch(&mut [
            wanting_logits(&next, a, true),
            wanting_logits(&next, b, true),
        ])
    };
    let room = ids.len() + 1;
    let want = step(&mut prefilled(room), &mut prefilled(room));
    for _ in 0..2 {
        let (mut ok, mut full) = (prefilled(room), prefilled(ids.len()));
        let failed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(&mut ok, &mut full)));
        assert!(failed.is_err(), "a chunk without room was computed");
        assert_eq!((ok.len, full.len), (ids.len(), ids.len()));
        let got = step(&mut prefilled(room), &mut prefilled(room));
        let moved = max_diff(&got, &want);
        assert_eq!(moved, 0.0, "the step after a failure moved by {moved}");
    }
}

/// With q8_0 a step whose decode and prompt chunks interleave runs them as two passes and gives
/// each chunk that wants logits its own row, in the chunks' order: the row it gets alone; a
/// chunk that wants none gets no row; every cache advances by its tokens; and a decode chunk
/// that tracks attention accumulates what it does alone.
#[test]
fn q8_0_interleaved_decode_and_prompt_chunks_keep_their_rows_and_caches() {
    let model = Llama::load(gguf(), WeightType::Q8_0).unwrap();
    let _guard = tch::no_grad_guard();
    let ids = france();
    let (short, next) = (&ids[..9], [42u32]);
    // Two decode sequences with different prompts, so that their rows differ.
    let prefilled = |prompt: &[u32], track: bool| {
        let mut kv = KvCache::new(&model.cfg, ids.len() + 2);
        if track {
            kv.track_attention(&model.cfg);
        }
        let _ = model.forward(prompt, &mut kv, true);
        kv
    };
    let fresh = || KvCache::new(&model.cfg, ids.len() + 2);
    let alone = |tokens: &[u32], kv: &mut KvCache, decode: bool| {
        model.forward_batch(&mut [wanting_logits(tokens, kv, decode)])
    };
    let (mut d1, mut d2) = (prefilled(&ids, false), prefilled(short, true));
    let (mut p1, mut p2) = (fresh(), fresh());
    let logits = model.forward_batch(&mut [
        wanting_logits(&ids, &mut p1, false),
        wanting_logits(&next, &mut d1, true),
        Chunk {
            tokens: short,
            kv: &mut p2,
            logits: false,
            decode: false,
        },
        wanting_logits(&next, &mut d2, true),
    ]);
    assert_eq!(logits.size(), [3, model.cfg.vocab as i64]);
    let expected = [
        alone(&ids, &mut fresh(), false),
        alone(&next, &mut prefilled(&ids, false), true),
        alone(&next, &mut prefilled(short, true), true),
    ];
    // The prompt row within f32 GEMM rounding (not batch-invariant); the decode rows, whose
    // attention ran on candle's pool threads, exactly.
    for (row, want) in expected.iter().enumerate() {
        let got = logits.narrow(0, row as i64, 1);
        let bound = if row == 0 { 1e-4 } else { 0.0 };
        assert!(
            max_diff(&got, want) <= bound,
            "row {row} moved by {}",
            max_diff(&got, want)
        );
    }
    assert!(
        max_diff(&expected[1], &expected[2]) > 1e-2,
        "the decode rows cannot tell apart"
    );
    assert_eq!(
        (p1.len, d1.len, p2.len, d2.len),
        (ids.len(), ids.len() + 1, short.len(), short.len() + 1)
    );
    let mut d2_alone = prefilled(short, true);
    let _ = alone(&next, &mut d2_alone, true);
    let (got, want) = (d2.attention(0).unwrap(), d2_alone.attention(0).unwrap());
    assert!(
        max_diff(&got, &want) == 0.0,
        "tracked attention moved by {}",
        max_diff(&got, &want)
    );
    assert!(d1.attention(0).is_none());
}

fn check_against_reference(weights: WeightType) {
    tch::set_num_threads(2);
    let model = Llama::load(gguf(), weights).unwrap();
    let ids = france();
    // Reference: the gguf package's dequantisation and a numpy forward pass.
    // One file per test: the f32 and bf16 tests run at once in this process.
    let out = std::env::temp_dir().join(format!(
        "engine-shim-ref-{}-{weights:?}.bin",
        std::process::id()
    ));
    let status = std::process::Command::new(root().join(".venv-ref/bin/python"))
        .arg(root().join("engine-shim/reference/llama_ref.py"))
        .arg(model_path())
        .arg(&out)
        .args(ids.iter().map(|i| i.to_string()))
        .status()
        .expect("run the reference (scripts/setup.sh creates .venv-ref)");
    assert!(status.success());
    let bytes = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let reference: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let vocab = model.cfg.vocab;
    assert_eq!(reference.len(), ids.len() * vocab);

    let ours = {
        let _guard = tch::no_grad_guard();
        let mut cache = KvCache::new(&model.cfg, ids.len());
        let l = if weights == WeightType::Q8_0 {
            let rows: Vec<Tensor> = ids
                .iter()
                .map(|&t| model.forward(&[t], &mut cache, false))
                .collect();
            Tensor::cat(&rows, 0)
        } else {
            model.forward(&ids, &mut cache, false)
        };
        Vec::<f32>::try_from(l.flatten(0, -1)).unwrap()
    };
    for pos in [0, ids.len() / 2, ids.len() - 1] {
        let a = &ours[pos * vocab..(pos + 1) * vocab];
        let b = &reference[pos * vocab..(pos + 1) * vocab];
        let r = correlation(a, b);
        eprintln!("{weights:?} position {pos}: correlation {r:.5}");
        // Q8_0 also quantises the activations to 8 bits (candle: one scale per 256 values),
        // which costs more than the weights' rounding: its bound is 0.98 (docs/engine-shim.md).
        let bound = if weights == WeightType::Q8_0 {
            0.98
        } else {
            0.999
        };
        assert!(r >= bound, "{weights:?} position {pos}: correlation {r}");
        if weights == WeightType::F32 {
            assert_eq!(argmax(a), argmax(b), "position {pos}: different top token");
        }
    }
    match weights {
        WeightType::F32 => {
            let answer = greedy(&model, &ids, 12, 256);
            let text = tok().decode(&answer).unwrap();
            assert!(
                text.starts_with("The capital of France is Paris"),
                "{text:?}"
            );
        }
        WeightType::Q8_0 => {
            for pos in 0..ids.len() {
                let b = &reference[pos * vocab..(pos + 1) * vocab];
                let picked = argmax(&ours[pos * vocab..(pos + 1) * vocab]);
                assert_near_top(b, picked, &format!("prompt position {pos}"));
            }
            q8_0_answer_is_near_top_under_f32(&model, &ids);
        }
        WeightType::Bf16 => {}
    }
}

/// How far (in f32 logits) below f32's top token Q8_0's may rank. Q8_0 flips near ties: at the
/// France prompt's last position f32 ranks "The" 0.08 above "L", and candle's AVX2 kernels pick
/// "L" (then answer "L'Étoile, la Cité, ...") where its AVX-512 VNNI ones pick "The". Measured
/// worst gaps: 0.25 with the AVX2 kernels, 0.80 with VNNI's coarser activation scales (prompt
/// position 1), and 1.06 at position 2 once decode steps' norms ran outside libtorch (another
/// rounding of the same sums flips other 8-bit activations; correlations stayed 0.986-0.996).
/// A broken kernel picks tokens ranked several logits lower.
const Q8_0_NEAR_TIE: f32 = 1.5;

fn assert_near_top(f32_logits: &[f32], picked: usize, at: &str) {
    let gap = f32_logits[argmax(f32_logits)] - f32_logits[picked];
    eprintln!("Q8_0 {at}: {gap:.3} below f32's top");
    assert!(
        gap <= Q8_0_NEAR_TIE,
        "{at}: Q8_0 picked {:?}, {gap} below f32's top token {:?}",
        tok().decode(&[picked as u32]).unwrap(),
        tok().decode(&[argmax(f32_logits) as u32]).unwrap()
    );
}

/// Q8_0's greedy answer, teacher-forced through the f32 model: every token it chose is one f32
/// ranks within [`Q8_0_NEAR_TIE`] of its own choice in the same context.
fn q8_0_answer_is_near_top_under_f32(q8: &Llama, prompt: &[u32]) {
    let answer = greedy(q8, prompt, 12, 1);
    eprintln!("Q8_0 answer: {:?}", tok().decode(&answer).unwrap());
    let f32_model = Llama::load(gguf(), WeightType::F32).unwrap();
    let _guard = tch::no_grad_guard();
    let all: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    let mut cache = KvCache::new(&f32_model.cfg, all.len());
    let logits = f32_model.forward(&all, &mut cache, false);
    for (i, &t) in answer.iter().enumerate() {
        let row = Vec::<f32>::try_from(logits.get((prompt.len() - 1 + i) as i64)).unwrap();
        assert_near_top(&row, t as usize, &format!("answer token {i}"));
    }
}

#[test]
fn chunked_prefill_gives_the_same_logits() {
    let model = Llama::load(gguf(), WeightType::F32).unwrap();
    let ids = france();
    let _guard = tch::no_grad_guard();
    let whole = {
        let mut c = KvCache::new(&model.cfg, ids.len());
        model.forward(&ids, &mut c, true)
    };
    let chunked = {
        let mut c = KvCache::new(&model.cfg, ids.len());
        let mut last = None;
        for ch in ids.chunks(5) {
            last = Some(model.forward(ch, &mut c, true));
        }
        last.unwrap()
    };
    let diff = (whole - chunked).abs().max().double_value(&[]);
    assert!(diff < 1e-3, "max logit difference {diff}");
}

fn correlation(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (
        a.iter().map(|&x| x as f64).sum::<f64>() / n,
        b.iter().map(|&x| x as f64).sum::<f64>() / n,
    );
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64 - ma, y as f64 - mb);
        sab += x * y;
        saa += x * x;
        sbb += y * y;
    }
    sab / (saa * sbb).sqrt()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

/// Segment spans on the real chat template and tokenizer: each passage's span is the tokens
/// lying inside its text (multi-byte text included), in order and disjoint; what no span holds
/// is the template, the system prompt and the question; and the offsets belong to the very
/// tokens the engine computes.
#[test]
fn segment_spans_on_the_real_template_hold_each_passage_and_nothing_else() {
    use engine_shim::segments;
    let passages = [
        "Passage 1: café crème, naïve façade, 3 €.\n",
        "Passage 2: 東京は日本の首都です。🙂\n",
        "Passage 3: plain ascii words only.\n",
    ];
    let parts: Vec<serde_json::Value> = passages
        .iter()
        .map(|p| serde_json::json!({"type": "text", "text": p}))
        .collect();
    let messages = serde_json::json!([
        {"role": "system", "content": "Answer from the passages."},
        {"role": "user", "content": parts},
        {"role": "user", "content": "Which passage mentions Tokyo?"}
    ]);
    let msgs = messages.as_array().unwrap();
    let t = tok();
    let pairs = engine_shim::tokenizer::chat::turns(Some(&messages)).unwrap();
    let rendered = t.render_chat(&pairs).unwrap();
    let starts = segments::content_starts(&pairs, &rendered, |p| t.render_chat(p))
        .expect("SmolLM2's template copies contents verbatim");
    let (ids, offsets) = t.encode_with_offsets(&rendered).unwrap();
    assert_eq!(ids, t.encode(&rendered).unwrap());
    assert_eq!(ids.len(), offsets.len());
    let units = segments::units(msgs, &[]).unwrap();
    let spans = segments::spans(msgs, &units, &starts, &offsets, 0.5);
    assert_eq!(spans.len(), 3);
    assert!(
        spans.windows(2).all(|w| w[0].end <= w[1].start),
        "ordered and disjoint"
    );
    // Only passage 2 has two sentences; each is a run of tokens inside its segment.
    assert!(spans[0].sentences.is_empty() && spans[2].sentences.is_empty());
    let two = &spans[1];
    assert_eq!(two.sentences.len(), 2, "{two:?}");
    let mut sentences: Vec<String> = Vec::new();
    for &(a, b) in &two.sentences {
        assert!(two.start <= a && a < b && b <= two.end, "{two:?}");
        sentences.push(t.decode(&ids[a..b]).unwrap());
    }
    sentences.sort();
    assert_eq!(sentences, ["Passage 2: 東京は日本の首都です。", "🙂\n"]);
    let mut outside: Vec<u32> = ids.clone();
    for (s, p) in spans.iter().zip(passages) {
        let text = t.decode(&ids[s.start..s.end]).unwrap();
        assert!(p.contains(text.trim()), "{text:?} inside {p:?}");
        // At most a token's worth at each boundary stays reserved.
        assert!(
            text.trim().len() + 8 >= p.trim().len(),
            "{text:?} covers {p:?}"
        );
        for x in &mut outside[s.start..s.end] {
            *x = u32::MAX;
        }
    }
    let rest: Vec<u32> = outside.into_iter().filter(|&x| x != u32::MAX).collect();
    let rest = t.decode(&rest).unwrap();
    assert!(
        rest.contains("Answer from the passages.")
            && rest.contains("Which passage mentions Tokyo?")
    );
    assert!(
        !rest.contains("東京") && !rest.contains("café") && !rest.contains("ascii"),
        "{rest:?}"
    );
}

/// A file's layer count and context length size buffers and tables before any tensor is read:
/// a layer count past what the file's tensors hold is refused (4 billion layers reserved 320
/// GiB of layer entries and aborted the process), and a context past `MAX_CONTEXT` is believed
/// only that far (4 billion positions asked libtorch for 16 GiB of RoPE angles). Zero layers,
/// positions or width are refused.
#[test]
fn layer_counts_and_contexts_from_the_file_are_believed_only_as_far_as_it_holds() {
    use engine_shim::gguf::Value;
    use engine_shim::model::{ModelError, MAX_CONTEXT, MAX_ROPE_VALUES};
    let with = |key: &str, v: u64| {
        let mut g = Gguf::parse(gguf().bytes().to_vec()).unwrap();
        g.metadata.insert(key.into(), Value::U64(v));
        g
    };
    for (key, v) in [
        ("llama.block_count", u64::from(u32::MAX)),
        ("llama.block_count", 31),
        ("llama.block_count", 0),
        ("llama.context_length", 0),
        ("llama.embedding_length", 0),
    ] {
        match Llama::load(&with(key, v), WeightType::F32) {
            Err(ModelError::Shape(m)) => assert!(!m.is_empty(), "{key} = {v}"),
            Err(e) => panic!("{key} = {v}: {e}"),
            Ok(_) => panic!("{key} = {v} was accepted"),
        }
    }
    let long = Llama::load(
        &with("llama.context_length", u64::from(u32::MAX)),
        WeightType::F32,
    )
    .expect("a long context is served up to the bound");
    assert_eq!(
        long.cfg.context, MAX_CONTEXT,
        "64-wide heads: the position bound applies"
    );
    // Three heads of 192 (one kv head, so K and V keep their 192 rows): the RoPE tables'
    // bound applies, 2^24 / 192 positions.
    let wide = Llama::load(
        &{
            let mut g = with("llama.context_length", u64::from(u32::MAX));
            g.metadata
                .insert("llama.attention.head_count".into(), Value::U64(3));
            g.metadata
                .insert("llama.attention.head_count_kv".into(), Value::U64(1));
            g
        },
        WeightType::F32,
    )
    .expect("wide heads load");
    assert_eq!(wide.cfg.head_dim, 192);
    assert_eq!(wide.cfg.context, MAX_ROPE_VALUES / 192);
    assert!(wide.cfg.context < MAX_CONTEXT);
    let mut kv = KvCache::new(&long.cfg, 4);
    let logits = long.forward(&france()[..4], &mut kv, true);
    assert_eq!(logits.size(), [1, long.cfg.vocab as i64]);
}

/// The vocabulary is sized and its special ids checked before anything is built from it: an
/// id past 2^32 was cut to 32 bits (2^32 + 1 became token 1), an id past the vocabulary named
/// no token, and a 100 MB entry disabled the prompt bound taken before tokenising. A tokenizer
/// with more tokens than the model embeds is refused at start.
#[test]
fn vocabularies_and_special_ids_from_the_file_are_checked() {
    use engine_shim::gguf::Value;
    use engine_shim::tokenizer::TokenizerError;
    let n = gguf().get_strings("tokenizer.ggml.tokens").unwrap().len() as u64;
    let with = |key: &str, v: Value| {
        let mut g = Gguf::parse(gguf().bytes().to_vec()).unwrap();
        g.metadata.insert(key.into(), v);
        g
    };
    let mut long = gguf()
        .get_strings("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|t| Value::Str(t.to_string()))
        .collect::<Vec<_>>();
    long[1000] = Value::Str("y".repeat(4096));
    for (key, v) in [
        ("tokenizer.ggml.bos_token_id", Value::U64((1 << 32) + 1)),
        ("tokenizer.ggml.eos_token_id", Value::U64(n)),
        ("tokenizer.ggml.tokens", Value::Array(long)),
        ("tokenizer.ggml.tokens", Value::Array(Vec::new())),
    ] {
        match ModelTokenizer::from_gguf(&with(key, v)) {
            Err(TokenizerError::Vocabulary(m)) => assert!(!m.is_empty(), "{key}"),
            Err(e) => panic!("{key}: {e}"),
            Ok(_) => panic!("{key} was accepted"),
        }
    }
    let last = ModelTokenizer::from_gguf(&with("tokenizer.ggml.eos_token_id", Value::U64(n - 1)))
        .expect("the last id is in the vocabulary");
    assert_eq!(last.eos as u64, n - 1);
    // One token more than the model embeds: the engine refuses to start with it.
    let mut more = gguf().get_strings("tokenizer.ggml.tokens").unwrap();
    more.push("<|one-more|>");
    let more = ModelTokenizer::from_gguf(&with(
        "tokenizer.ggml.tokens",
        Value::Array(more.iter().map(|t| Value::Str(t.to_string())).collect()),
    ))
    .expect("a tokenizer one token larger");
    let model = Llama::load(gguf(), WeightType::F32).unwrap();
    assert!(model.check_vocabulary(more.vocab_size()).is_err());
    assert!(model.check_vocabulary(tok().vocab_size()).is_ok());
}
