//! A request's KV eviction settings: the `kv_eviction` extension field of a chat or completion
//! request, and the token spans of its segments (docs/eviction.md, "API").
//!
//! ```json
//! "kv_eviction": {"policy": "segment", "budget_tokens": 512,
//!                 "segments": [{"message": 2, "relevance": 0.8},
//!                              {"message": 3, "part": 1, "reserved": true}]}
//! ```
//!
//! Segments are messages, or text parts of a message whose content is an array of parts. By
//! default the system (and developer) messages and the last user message are reserved and every
//! other message or part is a segment; an annotation overrides one message (all its parts) or
//! one part. Spans are found in the rendered prompt itself: the chat template is rendered once
//! more with a marker in place of each content, which gives where each content starts (and
//! proves the template copies contents verbatim), and the whole rendered prompt is tokenized
//! once; a segment is the tokens lying wholly inside its text, so a token that straddles a
//! boundary stays reserved. Relevance is the client's score where given, else BM25 of the
//! question (the last user message's reserved text) over the segments, times `decay` per turn
//! completed since the segment's message (assistant messages at or after it).

use kvmesh_filters::error::{ApiError, ErrorKind};
use serde_json::Value;

use crate::evict::{Policy, Segment};

/// Most annotations in `kv_eviction.segments`.
pub const MAX_ANNOTATIONS: usize = 1024;

fn bad(param: impl Into<String>, msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::InvalidRequest, msg).with_param(param)
}

/// One entry of `kv_eviction.segments`.
#[derive(Debug, Clone, PartialEq)]
pub struct Annotation {
    /// The message it is about.
    pub message: usize,
    /// The text part (`None`: every part of the message).
    pub part: Option<usize>,
    /// The client's relevance.
    pub relevance: Option<f64>,
    /// `true`: never evicted; `false`: a segment.
    pub reserved: Option<bool>,
}

/// The request's `kv_eviction` field, checked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// The policy (`None`: the engine's).
    pub policy: Option<Policy>,
    /// The budget (`None`: the engine's).
    pub budget_tokens: Option<usize>,
    /// Overrides of the default segments.
    pub annotations: Vec<Annotation>,
}

impl Request {
    /// Reads `kv_eviction` (absent or null: all defaults); `chat` says whether the request has
    /// messages for segments to refer to.
    pub fn parse(v: Option<&Value>, chat: bool) -> Result<Request, ApiError> {
        let obj = match v {
            None | Some(Value::Null) => return Ok(Request::default()),
            Some(Value::Object(o)) => o,
            Some(_) => return Err(bad("kv_eviction", "`kv_eviction` must be an object")),
        };
        let mut req = Request::default();
        for (k, v) in obj {
            let param = format!("kv_eviction.{k}");
            match k.as_str() {
                "policy" => {
                    let name = v
                        .as_str()
                        .ok_or_else(|| bad(&param, format!("`{param}` must be a string")))?;
                    req.policy = Some(
                        name.parse()
                            .map_err(|e| bad(&param, format!("`{param}`: {e}")))?,
                    );
                }
                "budget_tokens" => {
                    let n = v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                        bad(&param, format!("`{param}` must be a positive integer"))
                    })?;
                    req.budget_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
                }
                "segments" => {
                    if !chat {
                        return Err(bad(
                            &param,
                            format!("`{param}` refers to messages: use it on chat completions"),
                        ));
                    }
                    let list = v.as_array().filter(|a| a.len() <= MAX_ANNOTATIONS).ok_or_else(
                        || {
                            bad(
                                &param,
                                format!(
                                    "`{param}` must be an array of at most {MAX_ANNOTATIONS} objects"
                                ),
                            )
                        },
                    )?;
                    for (i, a) in list.iter().enumerate() {
                        req.annotations
                            .push(annotation(a, &format!("{param}[{i}]"))?);
                    }
                }
                _ => {
                    return Err(bad(
                        &param,
                        format!(
                        "`{param}` is not a kv_eviction field (policy, budget_tokens, segments)"
                    ),
                    ))
                }
            }
        }
        Ok(req)
    }
}

fn annotation(v: &Value, at: &str) -> Result<Annotation, ApiError> {
    let obj = v
        .as_object()
        .ok_or_else(|| bad(at, format!("`{at}` must be an object")))?;
    let index = |k: &str| -> Result<Option<usize>, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    bad(
                        format!("{at}.{k}"),
                        format!("`{at}.{k}` must be a non-negative integer"),
                    )
                }),
        }
    };
    let mut a = Annotation {
        message: index("message")?.ok_or_else(|| {
            bad(
                format!("{at}.message"),
                format!("`{at}.message` (the index of a message) is required"),
            )
        })?,
        part: index("part")?,
        relevance: None,
        reserved: None,
    };
    for (k, v) in obj {
        let param = format!("{at}.{k}");
        match k.as_str() {
            "message" | "part" => {}
            "relevance" => {
                // Not negative: decay shrinks a score towards 0, which must mean "less relevant".
                a.relevance = Some(
                    v.as_f64()
                        .filter(|x| x.is_finite() && *x >= 0.0)
                        .ok_or_else(|| {
                            bad(&param, format!("`{param}` must be a finite number >= 0"))
                        })?,
                )
            }
            "reserved" => {
                a.reserved = Some(
                    v.as_bool()
                        .ok_or_else(|| bad(&param, format!("`{param}` must be a boolean")))?,
                )
            }
            _ => {
                return Err(bad(
                    &param,
                    format!(
                        "`{param}` is not a segment field (message, part, relevance, reserved)"
                    ),
                ))
            }
        }
    }
    Ok(a)
}

/// A message or text part of the request, as eviction sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Unit {
    /// Its message.
    pub message: usize,
    /// Byte range within the message's content text (parts are joined with nothing between).
    pub start: usize,
    /// End of that range.
    pub end: usize,
    /// Never evicted.
    pub reserved: bool,
    /// The client's relevance, if given.
    pub relevance: Option<f64>,
}

/// The units of `messages` (the request's array, already checked by
/// `kvmesh_tokenize::chat::turns`) with the defaults and then `annotations` applied; an
/// annotation naming a message or part that does not exist is refused, naming it.
pub fn units(messages: &[Value], annotations: &[Annotation]) -> Result<Vec<Unit>, ApiError> {
    let last_user = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("user"));
    let mut units = Vec::new();
    // Per message: the index of its first unit, and the number of its text parts.
    let mut first = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let reserved = matches!(role, "system" | "developer") || Some(i) == last_user;
        first.push((units.len(), 0usize));
        let texts: Vec<&str> = match m.get("content") {
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(parts)) => parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
            _ => Vec::new(),
        };
        let mut at = 0usize;
        for t in &texts {
            units.push(Unit {
                message: i,
                start: at,
                end: at + t.len(),
                reserved,
                relevance: None,
            });
            at += t.len();
        }
        first[i].1 = texts.len();
    }
    for (k, a) in annotations.iter().enumerate() {
        let at = format!("kv_eviction.segments[{k}]");
        let &(from, parts) = first.get(a.message).ok_or_else(|| {
            bad(
                format!("{at}.message"),
                format!(
                    "`{at}.message`: there is no message {} (the request has {})",
                    a.message,
                    messages.len()
                ),
            )
        })?;
        let range = match a.part {
            None if parts == 0 => {
                return Err(bad(
                    format!("{at}.message"),
                    format!("`{at}.message`: message {} has no text", a.message),
                ))
            }
            None => from..from + parts,
            Some(p) if p < parts => from + p..from + p + 1,
            Some(p) => {
                return Err(bad(
                    format!("{at}.part"),
                    format!(
                        "`{at}.part`: message {} has no text part {p} (it has {parts})",
                        a.message
                    ),
                ))
            }
        };
        for u in &mut units[range] {
            u.reserved = a.reserved.unwrap_or(false);
            if a.relevance.is_some() {
                u.relevance = a.relevance;
            }
        }
    }
    Ok(units)
}

/// Where each message's content starts in `rendered` (`pairs` rendered by `render`), found by
/// rendering once more with a marker for each non-empty content; `None` when the template does
/// not copy contents verbatim (it edits them, or its output depends on them otherwise).
pub fn content_starts<E>(
    pairs: &[(String, String)],
    rendered: &str,
    render: impl Fn(&[(String, String)]) -> Result<String, E>,
) -> Option<Vec<usize>> {
    // Private-use characters: a marker that a content or template holds makes the check fail.
    let marker = |i: usize| format!("\u{F8F0}{i}\u{F8F1}");
    let marked: Vec<(String, String)> = pairs
        .iter()
        .enumerate()
        .map(|(i, (r, c))| (r.clone(), if c.is_empty() { c.clone() } else { marker(i) }))
        .collect();
    let template = render(&marked).ok()?;
    let mut starts = Vec::with_capacity(pairs.len());
    let mut rebuilt = String::with_capacity(rendered.len());
    let mut rest = template.as_str();
    for (i, (_, c)) in pairs.iter().enumerate() {
        if c.is_empty() {
            // No unit lies in an empty content: where it starts does not matter.
            starts.push(rebuilt.len());
            continue;
        }
        let m = marker(i);
        let at = rest.find(&m)?;
        rebuilt.push_str(&rest[..at]);
        starts.push(rebuilt.len());
        rebuilt.push_str(c);
        rest = &rest[at + m.len()..];
    }
    rebuilt.push_str(rest);
    // A marker left over (a template that copied a content twice) cannot be placed.
    (rebuilt == rendered && !rebuilt.contains('\u{F8F0}')).then_some(starts)
}

/// The tokens (by their byte `offsets` in the text, in order) lying wholly inside `from..to`,
/// as a token range; `None` when no token does.
pub fn token_span(offsets: &[(usize, usize)], from: usize, to: usize) -> Option<(usize, usize)> {
    let inside = |&(s, e): &(usize, usize)| s >= from && e <= to && e > s;
    // Offsets start in order: the first token at or after `from`, found by bisection.
    let first = offsets.partition_point(|&(s, _)| s < from);
    let first = first + offsets[first..].iter().take_while(|o| o.1 <= o.0).count();
    let len = offsets[first..].iter().take_while(|o| inside(o)).count();
    (len > 0).then_some((first, first + len))
}

/// Byte ranges of `text`'s sentences, in order: one ends after a line break, after `.`, `!` or
/// `?` followed by whitespace (or the end), or after `。`, `！` or `？`; the whitespace after it
/// starts the next one (tokenizers attach a space to the word after it). Whitespace-only
/// pieces are left out.
pub fn sentences(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let end = i + c.len_utf8();
        let spaced = chars.peek().is_none_or(|&(_, n)| n.is_whitespace());
        let ends = c == '\n'
            || matches!(c, '。' | '！' | '？')
            || (matches!(c, '.' | '!' | '?') && spaced);
        if ends {
            if !text[start..end].trim().is_empty() {
                out.push((start, end));
            }
            start = end;
        }
    }
    if !text[start..].trim().is_empty() {
        out.push((start, text.len()));
    }
    out
}

/// A segment's sentences as token spans (`span` maps a byte range of `text` to one), least
/// relevant first: BM25 of `question` over them, ties broken later first (a segment otherwise
/// goes from its end). Empty when the segment is one sentence.
fn ranked_sentences(
    question: &Bm25Query,
    text: &str,
    span: impl Fn(usize, usize) -> Option<(usize, usize)>,
) -> Vec<(usize, usize)> {
    let ranges = sentences(text);
    if ranges.len() < 2 {
        return Vec::new();
    }
    let texts: Vec<&str> = ranges.iter().map(|&(a, b)| &text[a..b]).collect();
    let scores = question.scores(&texts);
    let mut ranked: Vec<(f64, (usize, usize))> = ranges
        .iter()
        .zip(scores)
        .filter_map(|(&(a, b), score)| Some((score, span(a, b)?)))
        .collect();
    ranked.sort_by(|x, y| x.0.total_cmp(&y.0).then(y.1 .0.cmp(&x.1 .0)));
    ranked.into_iter().map(|(_, s)| s).collect()
}

/// BM25 (k1 = 1.2, b = 0.75; Robertson and Zaragoza's IDF, floored at 0) of `query` against each
/// of `docs`, over lower-cased alphanumeric words, in one pass over each document. Written here:
/// the crates that offer it bring stemmers and language detection that passages of a prompt do
/// not need.
pub fn bm25(query: &str, docs: &[&str]) -> Vec<f64> {
    Bm25Query::new(query).scores(docs)
}

/// A query's terms for [`bm25`], split once: the segment policy scores every segment's
/// sentences against the same question, and splitting it again per segment made a request
/// with many segments and a long question cost their product.
pub struct Bm25Query {
    terms: std::collections::HashSet<String>,
}

/// Lower-cased alphanumeric words of `s`.
fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

impl Bm25Query {
    /// The terms of `query`.
    pub fn new(query: &str) -> Self {
        Bm25Query {
            terms: words(query).into_iter().collect(),
        }
    }

    /// [`bm25`] of this query against each of `docs`.
    pub fn scores(&self, docs: &[&str]) -> Vec<f64> {
        use std::collections::HashMap;
        const K1: f64 = 1.2;
        const B: f64 = 0.75;
        let terms = &self.terms;
        // Per document: its length in words and how often each query term occurs in it.
        let docs: Vec<(usize, HashMap<&str, usize>)> = docs
            .iter()
            .map(|d| {
                let ws = words(d);
                let mut tf = HashMap::new();
                for w in &ws {
                    if let Some(t) = terms.get(w) {
                        *tf.entry(t.as_str()).or_insert(0) += 1;
                    }
                }
                (ws.len(), tf)
            })
            .collect();
        let mut df: HashMap<&str, usize> = HashMap::new();
        for (_, tf) in &docs {
            for t in tf.keys() {
                *df.entry(t).or_insert(0) += 1;
            }
        }
        let n = docs.len() as f64;
        let avg = (docs.iter().map(|d| d.0).sum::<usize>() as f64 / n.max(1.0)).max(1.0);
        docs.iter()
            .map(|(len, tf)| {
                tf.iter()
                    .map(|(t, &count)| {
                        let (tf, df) = (count as f64, df.get(t).copied().unwrap_or(0) as f64);
                        let idf = ((n - df + 0.5) / (df + 0.5) + 1.0).ln().max(0.0);
                        idf * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * *len as f64 / avg))
                    })
                    .sum()
            })
            .collect()
    }
}

/// The segment policy's spans for a rendered chat prompt: each non-reserved unit's tokens
/// (`offsets`: each token's byte range in `rendered`, BOS as an empty range), with its relevance
/// (the client's, else BM25 of the question), times `decay` per assistant message at or after
/// its message (the turns completed since it);
/// `starts` from [`content_starts`]. A unit no token lies wholly inside of is left out. Linear
/// in the request (plus a bisection per unit): every input here comes from the client.
pub fn spans(
    messages: &[Value],
    units: &[Unit],
    starts: &[usize],
    offsets: &[(usize, usize)],
    decay: f64,
) -> Vec<Segment> {
    let contents: Vec<String> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            kvmesh_tokenize::chat::content_text(m.get("content").unwrap_or(&Value::Null), i)
                .unwrap_or_default()
        })
        .collect();
    // later_replies[i]: assistant messages from message i on.
    let mut later_replies = vec![0usize; messages.len() + 1];
    for (i, m) in messages.iter().enumerate().rev() {
        let reply = m.get("role").and_then(Value::as_str) == Some("assistant");
        later_replies[i] = later_replies[i + 1] + usize::from(reply);
    }
    let text_of = |u: &Unit| -> &str {
        contents
            .get(u.message)
            .and_then(|c| c.get(u.start..u.end))
            .unwrap_or("")
    };
    let last_user = messages
        .iter()
        .rposition(|m| m.get("role").and_then(Value::as_str) == Some("user"));
    let question: String = units
        .iter()
        .filter(|u| u.reserved && Some(u.message) == last_user)
        .map(text_of)
        .collect::<Vec<_>>()
        .join(" ");
    let segs: Vec<&Unit> = units
        .iter()
        .filter(|u| !u.reserved && u.end > u.start)
        .collect();
    let texts: Vec<&str> = segs.iter().map(|u| text_of(u)).collect();
    let question = Bm25Query::new(&question);
    let scores = question.scores(&texts);
    let mut out = Vec::new();
    for (u, score) in segs.iter().zip(scores) {
        let Some(&base) = starts.get(u.message) else {
            continue;
        };
        let Some((start, end)) = token_span(offsets, base + u.start, base + u.end) else {
            continue;
        };
        // Turns completed since: an assistant message closes its own turn, so an earlier
        // answer ages with the question and passages of its turn.
        let age = later_replies.get(u.message).copied().unwrap_or(0);
        out.push(Segment {
            start,
            end,
            relevance: u.relevance.unwrap_or(score) * decay.powi(age.min(i32::MAX as usize) as i32),
            sentences: ranked_sentences(&question, text_of(u), |a, b| {
                token_span(offsets, base + u.start + a, base + u.start + b)
            }),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(pairs: &[(String, String)]) -> Result<String, ()> {
        Ok(pairs
            .iter()
            .map(|(r, c)| format!("<|im_start|>{r}\n{c}<|im_end|>\n"))
            .collect::<String>()
            + "<|im_start|>assistant\n")
    }

    fn pairs(m: &Value) -> Vec<(String, String)> {
        kvmesh_tokenize::chat::turns(Some(m)).expect("valid")
    }

    #[test]
    fn contents_are_placed_in_the_rendered_prompt_and_edits_are_detected() {
        let m = json!([
            {"role": "system", "content": "sé breve"},
            {"role": "user", "content": [{"type": "text", "text": "uno "}, {"type": "text", "text": "dos"}]},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "user"}
        ]);
        let p = pairs(&m);
        let rendered = render(&p).expect("renders");
        let starts = content_starts(&p, &rendered, render).expect("verbatim");
        for (s, (_, c)) in starts.iter().zip(&p) {
            assert_eq!(&rendered[*s..*s + c.len()], c);
        }
        // "user" as content is found at its place, not in the role header before it.
        assert_eq!(starts[3], rendered.rfind("user<|im_end|>").unwrap_or(0));
        // A template that trims contents is caught.
        let trimming = |p: &[(String, String)]| -> Result<String, ()> {
            Ok(p.iter().map(|(_, c)| c.trim().to_string() + "|").collect())
        };
        let p2 = pairs(&json!([{"role": "user", "content": " padded "}]));
        let r2 = trimming(&p2).expect("renders");
        assert_eq!(content_starts(&p2, &r2, trimming), None);
    }

    #[test]
    fn units_follow_the_defaults_and_annotations() {
        let m = json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "passage one"},
            {"role": "user", "content": [{"type": "text", "text": "p2 "}, {"type": "image_url"}, {"type": "text", "text": "question?"}]}
        ]);
        let msgs = m.as_array().expect("array");
        let u = units(msgs, &[]).expect("ok");
        let flags: Vec<(usize, usize, usize, bool)> = u
            .iter()
            .map(|u| (u.message, u.start, u.end, u.reserved))
            .collect();
        assert_eq!(
            flags,
            vec![
                (0, 0, 1, true),
                (1, 0, 11, false),
                (2, 0, 3, true),
                (2, 3, 12, true)
            ]
        );
        let ann = |message, part, relevance, reserved| Annotation {
            message,
            part,
            relevance,
            reserved,
        };
        let u = units(
            msgs,
            &[
                ann(2, Some(0), Some(0.5), None),
                ann(1, None, None, Some(true)),
            ],
        )
        .expect("ok");
        assert!(u[1].reserved);
        assert!(!u[2].reserved && u[2].relevance == Some(0.5));
        assert!(u[3].reserved);
        let e = units(msgs, &[ann(7, None, None, None)]).expect_err("no message 7");
        assert_eq!(e.param.as_deref(), Some("kv_eviction.segments[0].message"));
        let e = units(msgs, &[ann(2, Some(2), None, None)]).expect_err("two text parts");
        assert_eq!(e.param.as_deref(), Some("kv_eviction.segments[0].part"));
    }

    #[test]
    fn bad_annotations_are_refused_naming_the_field() {
        let param = |v: Value, chat: bool| {
            Request::parse(Some(&v), chat)
                .expect_err("refused")
                .param
                .unwrap_or_default()
        };
        assert_eq!(param(json!({"policy": "lru"}), true), "kv_eviction.policy");
        assert_eq!(
            param(json!({"budget_tokens": 0}), true),
            "kv_eviction.budget_tokens"
        );
        assert_eq!(
            param(json!({"budget_tokens": "5"}), true),
            "kv_eviction.budget_tokens"
        );
        assert_eq!(
            param(
                json!({"segments": [{"message": 1, "relevance": "high"}]}),
                true
            ),
            "kv_eviction.segments[0].relevance"
        );
        assert_eq!(
            param(json!({"segments": [{"message": 1}, {"part": 0}]}), true),
            "kv_eviction.segments[1].message"
        );
        assert_eq!(
            param(json!({"segments": [{"message": 1, "relevance": -1}]}), true),
            "kv_eviction.segments[0].relevance"
        );
        assert_eq!(
            param(json!({"segments": [{"message": 1, "weight": 2}]}), true),
            "kv_eviction.segments[0].weight"
        );
        assert_eq!(
            param(json!({"segments": []}), false),
            "kv_eviction.segments"
        );
        assert_eq!(param(json!({"window": 3}), true), "kv_eviction.window");
        assert_eq!(param(json!([1]), true), "kv_eviction");
        let ok = Request::parse(
            Some(&json!({"policy": "h2o", "budget_tokens": 64, "segments": [{"message": 0, "part": 1, "relevance": 1.5, "reserved": false}]})),
            true,
        )
        .expect("valid");
        assert_eq!(ok.policy, Some(Policy::H2o));
        assert_eq!(ok.budget_tokens, Some(64));
        assert_eq!(ok.annotations[0].part, Some(1));
    }

    #[test]
    fn sentences_split_after_terminators_and_line_breaks_multi_byte_included() {
        let t = "Grass is green. Pi is 3.14!  The end\nNext line。終わり？ tail";
        let got: Vec<&str> = sentences(t).into_iter().map(|(a, b)| &t[a..b]).collect();
        assert_eq!(
            got,
            [
                "Grass is green.",
                " Pi is 3.14!",
                "  The end\n",
                "Next line。",
                "終わり？",
                " tail"
            ]
        );
        assert_eq!(sentences("one sentence"), [(0, 12)]);
        assert!(sentences("  \n ").is_empty());
    }

    #[test]
    fn a_segments_sentences_rank_by_the_question_least_relevant_first() {
        let text = "The sky is blue. The magic number for Lisbon is 42. The sun is yellow.";
        // One token per byte, starting at byte 100.
        let span = |a: usize, b: usize| Some((100 + a, 100 + b));
        let ranked = ranked_sentences(
            &Bm25Query::new("What is the magic number for Lisbon?"),
            text,
            span,
        );
        // The two that share no rare word tie: the later one goes first.
        assert_eq!(ranked, [(151, 170), (100, 116), (116, 151)]);
        assert!(ranked_sentences(&Bm25Query::new("q"), "One sentence only.", span).is_empty());
    }

    #[test]
    fn token_spans_keep_straddling_tokens_reserved() {
        // Tokens: BOS, "ab", "c|d" (straddles 3), "ef", a multi-byte char split in two tokens
        // sharing its byte range.
        let offsets = [(0, 0), (0, 2), (2, 4), (4, 6), (6, 8), (6, 8)];
        assert_eq!(token_span(&offsets, 0, 3), Some((1, 2)));
        assert_eq!(token_span(&offsets, 3, 8), Some((3, 6)));
        assert_eq!(
            token_span(&offsets, 3, 7),
            Some((3, 4)),
            "half a character is not inside"
        );
        assert_eq!(token_span(&offsets, 2, 3), None);
    }

    #[test]
    fn relevance_decays_per_turn_completed_an_answer_with_its_own_turn() {
        let m = json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "Lisbon passage"},
            {"role": "assistant", "content": "Lisbon answer"},
            {"role": "user", "content": "Porto passage"},
            {"role": "user", "content": "What about Lisbon?"}
        ]);
        let msgs = m.as_array().expect("array");
        let p = pairs(&m);
        let rendered = render(&p).expect("renders");
        let starts = content_starts(&p, &rendered, render).expect("verbatim");
        // One token per byte.
        let offsets: Vec<(usize, usize)> = (0..rendered.len()).map(|i| (i, i + 1)).collect();
        let u = units(msgs, &[]).expect("ok");
        let spans = spans(msgs, &u, &starts, &offsets, 0.5);
        let texts = ["Lisbon passage", "Lisbon answer", "Porto passage"];
        let scores = bm25("What about Lisbon?", &texts);
        assert_eq!(spans.len(), 3);
        for ((s, text), (score, age)) in spans.iter().zip(texts).zip(scores.iter().zip([1, 1, 0])) {
            assert_eq!(&rendered[s.start..s.end], text);
            assert!(
                (s.relevance - score * 0.5f64.powi(age)).abs() < 1e-12,
                "{text}: {spans:?}"
            );
        }
    }

    #[test]
    fn bm25_ranks_the_passage_that_shares_the_questions_words() {
        let s = bm25(
            "What is the magic number for Lisbon?",
            &[
                "Grass grows green.",
                "The magic number for Lisbon is 4821.",
                "Lisbon is a city.",
            ],
        );
        assert!(s[1] > s[2] && s[2] > s[0], "{s:?}");
        assert_eq!(s[0], 0.0);
    }
}
