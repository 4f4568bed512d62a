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

/// Finds the top-level `usage` of a JSON response body fed chunk by chunk, as it passes
/// through, keeping only that value's bytes (at most `max_value` of them): memory stays
/// bounded whatever the body's size, and `usage` counts wherever it stands among the keys.
///
/// It follows strings, escapes and nesting, not the rest of JSON's grammar: a body that is
/// not JSON yields whatever its last top-level `"usage":` value parses to, or nothing. A
/// `usage` key written with escapes (`"\u0075sage"`) is not recognised. Of repeated
/// top-level `usage` keys the last counts, as in a full parse.
#[derive(Debug)]
pub struct JsonUsageScanner {
    max_value: usize,
    /// Nesting depth outside strings.
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// The depth-1 container is an object (so its strings after `{` and `,` are keys).
    top_object: bool,
    /// At depth 1 of the object, where the next string is a key.
    key_next: bool,
    /// The depth-1 key being read, while it can still spell `usage`.
    key: Option<Vec<u8>>,
    /// The last depth-1 key read was `usage` (its `:` not yet seen).
    usage_key: bool,
    capture: Capture,
    /// The bytes of the last complete top-level `usage` value (`None` when it was too long).
    value: Option<Vec<u8>>,
}

#[derive(Debug)]
enum Capture {
    Off,
    On(Vec<u8>),
    /// The value passed `max_value` bytes.
    TooLong,
}

impl JsonUsageScanner {
    /// A scanner that keeps at most `max_value` bytes of the `usage` value.
    pub fn new(max_value: usize) -> Self {
        JsonUsageScanner {
            max_value,
            depth: 0,
            in_string: false,
            escaped: false,
            top_object: false,
            key_next: false,
            key: None,
            usage_key: false,
            capture: Capture::Off,
            value: None,
        }
    }

    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some((&b, tail)) = rest.split_first() {
            self.step(b);
            rest = tail;
            // Bytes that cannot change anything are skipped in bulk: an engine's answer is
            // mostly text and numbers (a long completion, an embedding's floats), and this
            // runs over every byte of it.
            if matches!(self.capture, Capture::Off) {
                let skip = if self.in_string {
                    if self.escaped || self.key.is_some() {
                        0
                    } else {
                        memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len())
                    }
                } else if self.depth > 1 {
                    // The next byte that opens a string or changes the depth.
                    let brace = memchr::memchr3(b'"', b'{', b'}', rest).unwrap_or(rest.len());
                    memchr::memchr2(b'[', b']', &rest[..brace]).unwrap_or(brace)
                } else {
                    0
                };
                rest = &rest[skip..];
            }
        }
    }

    fn step(&mut self, b: u8) {
        if self.in_string {
            self.keep(b);
            if self.escaped {
                self.escaped = false;
                // An escape in a key: not the plain spelling of `usage`.
                self.key = None;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                if let Some(key) = self.key.take() {
                    self.usage_key = key == b"usage";
                }
            } else if let Some(key) = self.key.as_mut() {
                if key.len() < b"usage".len() {
                    key.push(b);
                } else {
                    self.key = None;
                }
            }
            return;
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.key_next {
                    self.key_next = false;
                    self.key = Some(Vec::new());
                }
            }
            b'{' | b'[' => {
                self.depth = self.depth.saturating_add(1);
                if self.depth == 1 {
                    self.top_object = b == b'{';
                    self.key_next = self.top_object;
                }
            }
            b'}' | b']' if self.depth == 1 => {
                self.end_value();
                self.depth = 0;
                return;
            }
            b'}' | b']' => self.depth = self.depth.saturating_sub(1),
            b',' if self.depth == 1 => {
                self.end_value();
                self.key_next = self.top_object;
                return;
            }
            b':' if self.depth == 1 && self.usage_key => {
                self.usage_key = false;
                self.capture = Capture::On(Vec::new());
                return;
            }
            _ => {}
        }
        self.keep(b);
    }

    /// Keeps `b` if it is part of a `usage` value.
    fn keep(&mut self, b: u8) {
        if let Capture::On(v) = &mut self.capture {
            if v.len() < self.max_value {
                v.push(b);
            } else {
                self.capture = Capture::TooLong;
            }
        }
    }

    /// A depth-1 value ended (at `,` or the closing bracket).
    fn end_value(&mut self) {
        match std::mem::replace(&mut self.capture, Capture::Off) {
            Capture::Off => {}
            Capture::On(v) => self.value = Some(v),
            Capture::TooLong => self.value = None,
        }
    }

    /// The usage of the body fed so far: of the last complete top-level `usage` value.
    pub fn usage(&self) -> Option<Usage> {
        from_usage_value(self.value.as_deref()?)
    }
}

/// The usage a `usage` value (its JSON bytes alone) holds: none for `null` or anything that is
/// not a usage object.
pub fn from_usage_value(value: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<Option<RawUsage>>(value)
        .ok()
        .flatten()
        .map(Usage::from)
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

    fn scan(body: &[u8], max_value: usize) -> Option<Usage> {
        let mut s = JsonUsageScanner::new(max_value);
        s.feed(body);
        s.usage()
    }

    #[test]
    fn json_usage_scanned_in_chunks_wherever_it_stands() {
        let full = Usage {
            prompt_tokens: 10,
            cached_tokens: Some(8),
            completion_tokens: Some(2),
        };
        let usage = br#"{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}"#;
        let u = String::from_utf8_lossy(usage);
        let bodies = [
            format!(r#"{{"id":"x","choices":[{{"text":"a"}}],"usage":{u}}}"#),
            // First, then a long field after it (vLLM's prompt_token_ids, say).
            format!(
                r#"{{"usage" : {u} , "prompt_token_ids":[{}1]}}"#,
                "1,".repeat(5000)
            ),
            // Decoys: in a string, escaped, nested, in an array.
            format!(
                r#"{{"choices":[{{"text":"\"usage\":{{\"prompt_tokens\":9}}","usage":{{"prompt_tokens":9}}}}],"\u0075sage":{{"prompt_tokens":9}},"usage":{u},"x":[{{"usage":1}}]}}"#
            ),
        ];
        for body in &bodies {
            let body = body.as_bytes();
            assert!(
                serde_json::from_slice::<serde_json::Value>(body).is_ok(),
                "not JSON"
            );
            assert_eq!(
                scan(body, 1 << 10),
                Some(full),
                "{}",
                String::from_utf8_lossy(body)
            );
            for split in (1..body.len()).step_by(7) {
                let mut s = JsonUsageScanner::new(1 << 10);
                s.feed(&body[..split]);
                s.feed(&body[split..]);
                assert_eq!(s.usage(), Some(full), "split {split}");
            }
        }
        // Escapes: a quote or a backslash escaped in a string does not end it; a key spelt
        // with escapes is not `usage`.
        let escaped = br#"{"a":"\"usage\":{\"prompt_tokens\":9},\\","b\"usage":{"prompt_tokens":9},"\u0075sage":{"prompt_tokens":9},"usage":{"prompt_tokens":4}}"#;
        assert!(serde_json::from_slice::<serde_json::Value>(escaped).is_ok());
        assert_eq!(scan(escaped, 64).map(|u| u.prompt_tokens), Some(4));
        let only_escaped = br#"{"a":"x\\","\u0075sage":{"prompt_tokens":9}}"#;
        assert!(serde_json::from_slice::<serde_json::Value>(only_escaped).is_ok());
        assert_eq!(scan(only_escaped, 64), None);
        // The last top-level usage counts, as in a full parse.
        assert_eq!(
            scan(
                br#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
                64
            )
            .map(|u| u.prompt_tokens),
            Some(2)
        );
        // Too long to keep, absent, null, unfinished, not JSON: none.
        assert_eq!(scan(bodies[0].as_bytes(), 16), None);
        for body in [
            &br#"{"choices":[]}"#[..],
            br#"{"usage":null}"#,
            br#"{"usage":{"prompt_tokens":10"#,
            br#"[{"usage":{"prompt_tokens":10}}]"#,
            b"not json",
        ] {
            assert_eq!(
                scan(body, 1 << 10),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
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
