//! Reading `usage` (prompt, cached and completion token counts) out of engine responses, JSON or
//! SSE.

use serde::Deserialize;

/// Token counts an engine reported for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`, when the engine reports it (embeddings have none).
    pub completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Envelope {
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct RawUsage {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The usage of a complete JSON response body, if it has one.
///
/// Engines put `usage` last, so the object after the last `"usage":` is parsed alone (a full
/// parse of a long completion or embedding would cost far more); anything unexpected falls
/// back to parsing the whole body.
pub fn from_json(body: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    if let Some(at) = rfind(body, KEY) {
        let rest = &body[at + KEY.len()..];
        let colon = rest.iter().position(|&b| !b.is_ascii_whitespace());
        if let Some(i) = colon.filter(|&i| rest[i] == b':') {
            let mut values = serde_json::Deserializer::from_slice(&rest[i + 1..])
                .into_iter::<Option<RawUsage>>();
            if let Some(Ok(u)) = values.next() {
                return u.map(Usage::from);
            }
        }
    }
    let env: Envelope = serde_json::from_slice(body).ok()?;
    env.usage.map(Usage::from)
}

impl From<RawUsage> for Usage {
    fn from(u: RawUsage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
            completion_tokens: u.completion_tokens,
        }
    }
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

/// Finds the usage in a server-sent-event stream fed chunk by chunk, as it passes through.
/// Lines longer than `max_line` bytes are skipped, so memory stays bounded.
#[derive(Debug)]
pub struct SseUsageScanner {
    line: Vec<u8>,
    max_line: usize,
    skipping: bool,
    usage: Option<Usage>,
}

impl SseUsageScanner {
    /// A scanner that keeps at most `max_line` bytes of a partial line.
    pub fn new(max_line: usize) -> Self {
        SseUsageScanner {
            line: Vec::new(),
            max_line,
            skipping: false,
            usage: None,
        }
    }

    /// Feeds the next chunk of the stream.
    pub fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            match chunk.iter().position(|&b| b == b'\n') {
                Some(pos) => {
                    if !self.skipping && self.line.len() + pos <= self.max_line {
                        self.line.extend_from_slice(&chunk[..pos]);
                        self.finish_line();
                    }
                    self.line.clear();
                    self.skipping = false;
                    chunk = &chunk[pos + 1..];
                }
                None => {
                    if !self.skipping {
                        if self.line.len() + chunk.len() > self.max_line {
                            self.skipping = true;
                            self.line.clear();
                        } else {
                            self.line.extend_from_slice(chunk);
                        }
                    }
                    return;
                }
            }
        }
    }

    fn finish_line(&mut self) {
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        if !contains(data, b"\"prompt_tokens\"") {
            return;
        }
        if let Some(u) = from_json(data) {
            self.usage = Some(u);
        }
    }

    /// The last usage seen so far.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_usage() {
        let u = from_json(br#"{"id":"x","usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}"#);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: Some(8),
                completion_tokens: Some(2),
            })
        );
        let u = from_json(br#"{"usage":{"prompt_tokens":10}}"#);
        assert_eq!(
            u,
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: None,
                completion_tokens: None,
            })
        );
        assert_eq!(from_json(b"not json"), None);
        // A "usage" inside content does not fool the fast path: the last key wins.
        let u = from_json(
            br#"{"choices":[{"text":"the \"usage\": field"}],"usage":{"prompt_tokens":3}}"#,
        );
        assert_eq!(u.map(|u| u.prompt_tokens), Some(3));
        assert_eq!(from_json(br#"{"usage":null}"#), None);
        // No usage key at the end, but one in text: falls back to the full parse.
        assert_eq!(from_json(br#"{"choices":[{"text":"\"usage\": 5"}]}"#), None);
    }

    #[test]
    fn sse_usage_across_chunk_boundaries() {
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\r\n\r\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let mut s = SseUsageScanner::new(1 << 16);
            s.feed(&stream[..split]);
            s.feed(&stream[split..]);
            assert_eq!(
                s.usage(),
                Some(Usage {
                    prompt_tokens: 7,
                    cached_tokens: Some(4),
                    completion_tokens: Some(3),
                }),
                "split {split}"
            );
        }
    }

    #[test]
    fn long_lines_are_skipped() {
        let mut s = SseUsageScanner::new(16);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}} padding padding\n");
        assert_eq!(s.usage(), None);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}}\n");
        assert_eq!(s.usage(), None, "still over 16 bytes");
        let mut s = SseUsageScanner::new(1024);
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1}}\n");
        assert_eq!(s.usage().map(|u| u.prompt_tokens), Some(1));
    }
}
