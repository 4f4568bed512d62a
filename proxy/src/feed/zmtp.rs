//! A ZeroMQ (ZMTP 3.1, NULL security) client of the two sockets a KV events publisher binds:
//! SUB to its PUB socket, DEALER to its replay ROUTER socket.
//!
//! Hand-written, and small, because what reaches it is hostile: a peer states each frame's
//! length in 8 bytes, and the maintained pure-Rust implementation (`zeromq` 0.7) reserves
//! whatever a frame states, so one forged length aborts the process; `libzmq` bindings bound
//! messages (`ZMQ_MAXMSGSIZE`) but bring a C library into every image. Here a frame over
//! `max_frame` bytes or a message of more than `max_parts` frames ends the connection, before
//! its body is waited for.
//!
//! Liveness: the client pings an idle connection (a ZMTP 3.1 PING, which libzmq answers)
//! and gives the connection up when nothing arrives for [`Zmtp::recv`]'s `idle` plus the
//! pong timeout, so a publisher that vanished without closing is noticed.
//!
//! What [`Zmtp::recv`] writes (PING, PONG) is queued and written alongside its reads, never
//! awaited alone: a `recv` dropped by a timer leaves no half frame on the wire, and a peer that
//! sends pings but reads nothing stops being read once [`MAX_UNSENT`] bytes wait, then is given
//! up when nothing more could be written for [`WRITE_TIMEOUT`].

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Longest greeting-to-ready exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for anything after a ping.
const PONG_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a write may make no progress (the peer reads nothing).
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most bytes of answers queued for the peer: beyond them its frames are not read until some
/// are written.
const MAX_UNSENT: usize = 4096;
/// Most properties accepted in a peer's READY.
const MAX_PROPERTIES: usize = 64;

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The TCP connection failed or closed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer did not finish the handshake in time, or was silent after a ping.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// A frame or message was larger than allowed.
    #[error("{0}")]
    TooLarge(String),
}

fn protocol(msg: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(msg.into())
}

/// Most bytes of peer-chosen text quoted in an error (which is logged at every reconnect).
const MAX_QUOTED: usize = 64;

/// Peer-chosen bytes as they go into an error: at most [`MAX_QUOTED`] of them, escaped, so a
/// peer can neither flood the log nor write lines of its own into it.
fn quoted(bytes: &[u8]) -> String {
    let shown = bytes.get(..MAX_QUOTED).unwrap_or(bytes);
    let more = if shown.len() < bytes.len() { "..." } else { "" };
    format!("\"{}\"{more}", shown.escape_ascii())
}

/// The socket type this end plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Subscriber, of a PUB or XPUB peer.
    Sub,
    /// Dealer, of a ROUTER peer.
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// The peer socket types this one talks to.
    fn peers(self) -> &'static [&'static [u8]] {
        match self {
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER"],
        }
    }
}

/// Bounds on what a peer may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest frame, bytes.
    pub max_frame: usize,
    /// Most frames in one message.
    pub max_parts: usize,
    /// Longest one frame may take to arrive once its first byte has: a peer that trickles a
    /// frame's bytes is alive by every other measure (each byte resets the idle timer), so
    /// without it a stalled publisher would hold the connection, and the residency last heard
    /// from it, forever.
    pub max_frame_time: Duration,
}

/// One frame as read: its flags and body.
struct Frame {
    more: bool,
    command: bool,
    body: Bytes,
}

/// One connection, after the handshake.
///
/// Reading is cancel safe: bytes read and frames of a message not yet complete are kept here,
/// so a [`Zmtp::recv`] dropped by a timer (`select!`, a timeout) loses nothing.
pub struct Zmtp {
    stream: TcpStream,
    limits: Limits,
    /// Bytes read and not yet parsed.
    buf: BytesMut,
    /// Frames of the message being received.
    parts: Vec<Bytes>,
    /// Bytes queued for the peer and not yet written.
    out: BytesMut,
    /// When a write last made progress, or the queue was last empty.
    wrote_at: Instant,
    /// When the peer last sent anything.
    heard_at: Instant,
    /// When we pinged it, if it has sent nothing since.
    pinged_at: Option<Instant>,
    /// When `buf` first held part of a frame not yet whole ([`Limits::max_frame_time`]).
    partial_since: Option<Instant>,
}

/// Most bytes asked of the socket per read.
const READ_CHUNK: usize = 64 << 10;

impl Zmtp {
    /// Connects to `addr` (`host:port`) as `kind` and completes the handshake (greeting, NULL
    /// mechanism, READY both ways, the peer's socket type checked).
    pub async fn connect(addr: &str, kind: SocketType, limits: Limits) -> Result<Self, ZmtpError> {
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| ZmtpError::Timeout("connect"))??;
        stream.set_nodelay(true)?;
        let now = Instant::now();
        let mut z = Zmtp {
            stream,
            limits,
            buf: BytesMut::new(),
            parts: Vec::new(),
            out: BytesMut::new(),
            wrote_at: now,
            heard_at: now,
            pinged_at: None,
            partial_since: None,
        };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, z.handshake(kind))
            .await
            .map_err(|_| ZmtpError::Timeout("handshake"))??;
        Ok(z)
    }

    async fn handshake(&mut self, kind: SocketType) -> Result<(), ZmtpError> {
        self.stream.write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        self.stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] & 1 != 1 {
            return Err(protocol("not a ZMTP peer (bad signature)"));
        }
        // 3.1: the SUBSCRIBE command and PING, which 3.0 peers do not know.
        if (peer[10], peer[11]) < (3, 1) {
            return Err(protocol(format!(
                "ZMTP {}.{} is not supported (3.1 or later)",
                peer[10], peer[11]
            )));
        }
        if &peer[12..32] != b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0" {
            return Err(protocol(
                "the peer asks for a security mechanism other than NULL (CURVE and PLAIN are not supported)",
            ));
        }
        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        put_property(&mut ready, b"Socket-Type", kind.name());
        if kind == SocketType::Dealer {
            put_property(&mut ready, b"Identity", b"");
        }
        put_frame(&mut self.out, &ready, false, true);
        self.flush().await?;
        let frame = self.read_frame().await?;
        if !frame.command {
            return Err(protocol("expected READY, got a message"));
        }
        let (name, data) = command_parts(&frame.body)?;
        match name {
            b"READY" => {}
            b"ERROR" => {
                // The reason is a short string: one length byte, then at most 255 bytes.
                let reason = match data.split_first() {
                    Some((&n, rest)) => rest.get(..usize::from(n)).unwrap_or(rest),
                    None => &[],
                };
                return Err(protocol(format!("the peer refused: {}", quoted(reason))));
            }
            other => return Err(protocol(format!("expected READY, got {}", quoted(other)))),
        }
        let peer_type = ready_socket_type(data)?;
        if !kind.peers().contains(&peer_type.as_slice()) {
            return Err(protocol(format!(
                "the peer is a {} socket, not {}",
                quoted(&peer_type),
                kind.peers()
                    .iter()
                    .map(|p| String::from_utf8_lossy(p).into_owned())
                    .collect::<Vec<_>>()
                    .join(" or ")
            )));
        }
        Ok(())
    }

    /// Subscribes to messages whose first frame starts with `topic` (empty: all).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut body = Vec::with_capacity(10 + topic.len());
        body.push(9);
        body.extend_from_slice(b"SUBSCRIBE");
        body.extend_from_slice(topic);
        put_frame(&mut self.out, &body, false, true);
        self.flush().await
    }

    /// Sends one message of `parts`.
    pub async fn send(&mut self, parts: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, p) in parts.iter().enumerate() {
            put_frame(&mut self.out, p, i + 1 < parts.len(), false);
        }
        self.flush().await
    }

    /// Writes what is queued, each write making progress within [`WRITE_TIMEOUT`].
    async fn flush(&mut self) -> Result<(), ZmtpError> {
        while !self.out.is_empty() {
            let n = tokio::time::timeout(WRITE_TIMEOUT, self.stream.write_buf(&mut self.out))
                .await
                .map_err(|_| ZmtpError::Timeout("the peer reads nothing"))??;
            self.wrote(n)?;
        }
        self.wrote_at = Instant::now();
        Ok(())
    }

    /// Writes what is queued as far as the socket takes it now, without waiting: answers go
    /// out even while messages already read are being returned.
    fn write_now(&mut self) -> Result<(), ZmtpError> {
        while !self.out.is_empty() {
            match self.stream.try_write(&self.out) {
                Ok(n) => {
                    self.wrote(n)?;
                    self.out.advance(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Reads what the socket holds now, without waiting; whether anything came.
    fn read_now(&mut self) -> Result<bool, ZmtpError> {
        self.buf.reserve(READ_CHUNK);
        match self.stream.try_read_buf(&mut self.buf) {
            Ok(n) => self.heard(n).map(|()| true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The next message. When nothing arrives for `idle`, the peer is pinged; when nothing
    /// answers that either, the connection is given up. Commands (PONG, PING) are handled here.
    /// Cancel safe: what was read, and what is queued to be written, stays for the next call.
    pub async fn recv(&mut self, idle: Duration) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            self.write_now()?;
            // Frames are taken only while the answers to them can be queued.
            if self.out.len() < MAX_UNSENT {
                if let Some(frame) = self.parse_frame()? {
                    if let Some(message) = self.take(frame)? {
                        return Ok(message);
                    }
                    continue;
                }
            }
            let reading = self.out.len() < MAX_UNSENT;
            let writing = !self.out.is_empty();
            let (from, wait) = if writing {
                (self.wrote_at, WRITE_TIMEOUT)
            } else {
                self.pinged_at
                    .map_or((self.heard_at, idle), |at| (at, PONG_TIMEOUT))
            };
            // A far-off deadline for an `idle` too long to add.
            let far = || Instant::now() + Duration::from_secs(365 * 86_400);
            let deadline = from.checked_add(wait).unwrap_or_else(far);
            let frame_deadline = self
                .partial_since
                .and_then(|at| at.checked_add(self.limits.max_frame_time));
            self.buf.reserve(READ_CHUNK);
            let (mut rd, mut wr) = self.stream.split();
            // Writes first (they are bounded, and a peer may count only what it receives as
            // our being alive), then reads, the timer last.
            tokio::select! {
                biased;
                n = wr.write_buf(&mut self.out), if writing => self.wrote(n?)?,
                n = rd.read_buf(&mut self.buf), if reading => self.heard(n?)?,
                _ = tokio::time::sleep_until(frame_deadline.unwrap_or_else(far)),
                    if frame_deadline.is_some() =>
                {
                    return Err(ZmtpError::Timeout("a frame took too long to arrive"));
                }
                _ = tokio::time::sleep_until(deadline) => {
                    // What the socket holds now, before its readiness reached the runtime
                    // (a caller slow between two calls), still counts.
                    if writing {
                        self.write_now()?;
                        if self.wrote_at < deadline {
                            return Err(ZmtpError::Timeout("the peer reads nothing"));
                        }
                        continue;
                    }
                    if self.read_now()? {
                        continue;
                    }
                    if self.pinged_at.is_some() {
                        return Err(ZmtpError::Timeout("no answer to a ping"));
                    }
                    // TTL 0: no claim on how long the peer should wait for us.
                    self.queue(b"\x04PING\x00\x00");
                    self.pinged_at = Some(Instant::now());
                }
            }
        }
    }

    /// `n` bytes were written: none means the socket takes no more, ever; any is progress.
    fn wrote(&mut self, n: usize) -> Result<(), ZmtpError> {
        if n == 0 {
            return Err(ZmtpError::Io(std::io::ErrorKind::WriteZero.into()));
        }
        self.wrote_at = Instant::now();
        Ok(())
    }

    /// `n` bytes were read: none means the peer closed; any is a sign of life.
    fn heard(&mut self, n: usize) -> Result<(), ZmtpError> {
        if n == 0 {
            return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.heard_at = Instant::now();
        self.pinged_at = None;
        Ok(())
    }

    /// Takes one frame: a command is handled (a PING answered), a message frame added to the
    /// message being received; returns the message once its last frame came.
    fn take(&mut self, frame: Frame) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        if frame.command {
            let (name, data) = command_parts(&frame.body)?;
            match name {
                b"PING" => {
                    // PONG carries the ping's context (after its 2-byte TTL; at most 16 bytes,
                    // RFC 37).
                    let context = data.get(2..).unwrap_or_default();
                    let context = &context[..context.len().min(16)];
                    let mut pong = Vec::with_capacity(5 + context.len());
                    pong.push(4);
                    pong.extend_from_slice(b"PONG");
                    pong.extend_from_slice(context);
                    self.queue(&pong);
                }
                b"ERROR" => return Err(protocol("the peer sent ERROR")),
                _ => {}
            }
            return Ok(None);
        }
        if self.parts.len() == self.limits.max_parts {
            return Err(ZmtpError::TooLarge(format!(
                "a message of more than {} frames",
                self.limits.max_parts
            )));
        }
        self.parts.push(frame.body);
        Ok((!frame.more).then(|| std::mem::take(&mut self.parts)))
    }

    /// Queues a command frame for the peer.
    fn queue(&mut self, command: &[u8]) {
        if self.out.is_empty() {
            self.wrote_at = Instant::now();
        }
        put_frame(&mut self.out, command, false, true);
    }

    /// The next frame; cancel safe (what was read stays in `buf`).
    async fn read_frame(&mut self) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(frame) = self.parse_frame()? {
                return Ok(frame);
            }
            self.buf.reserve(READ_CHUNK);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// `buf` holds part of a frame, not all of it: no frame yet, and the frame's time runs from
    /// its first byte ([`Limits::max_frame_time`]).
    fn partial(&mut self) -> Option<Frame> {
        self.partial_since.get_or_insert_with(Instant::now);
        None
    }

    /// A whole frame from `buf`, if it holds one. A stated length over the bound is refused
    /// before anything is waited for.
    fn parse_frame(&mut self) -> Result<Option<Frame>, ZmtpError> {
        let Some(&flags) = self.buf.first() else {
            return Ok(None);
        };
        let (head, len) = if flags & 0x02 != 0 {
            let Some(b) = self.buf.get(1..9) else {
                return Ok(self.partial());
            };
            let mut n = [0u8; 8];
            n.copy_from_slice(b);
            (9, u64::from_be_bytes(n))
        } else {
            let Some(&n) = self.buf.get(1) else {
                return Ok(self.partial());
            };
            (2, u64::from(n))
        };
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= self.limits.max_frame)
            .ok_or_else(|| {
                ZmtpError::TooLarge(format!(
                    "a frame of {len} bytes (at most {})",
                    self.limits.max_frame
                ))
            })?;
        if self.buf.len() < head + len {
            return Ok(self.partial());
        }
        self.partial_since = None;
        let _ = self.buf.split_to(head);
        Ok(Some(Frame {
            more: flags & 0x01 != 0,
            command: flags & 0x04 != 0,
            body: self.buf.split_to(len).freeze(),
        }))
    }
}

/// Appends one frame of `body` to `out`.
fn put_frame(out: &mut BytesMut, body: &[u8], more: bool, command: bool) {
    let mut flags = u8::from(more) | if command { 0x04 } else { 0 };
    match u8::try_from(body.len()) {
        Ok(n) => {
            out.extend_from_slice(&[flags, n]);
        }
        Err(_) => {
            flags |= 0x02;
            out.extend_from_slice(&[flags]);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// This end's greeting: signature, version 3.1, mechanism NULL, as-server 0, filler.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn put_property(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    // Names and values here are constants, well under their length fields' bounds.
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

/// A command's name and data.
fn command_parts(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let (&n, rest) = body
        .split_first()
        .ok_or_else(|| protocol("an empty command"))?;
    if rest.len() < usize::from(n) {
        return Err(protocol("a command name longer than its frame"));
    }
    Ok(rest.split_at(usize::from(n)))
}

/// The `Socket-Type` property of a READY command's data.
fn ready_socket_type(mut data: &[u8]) -> Result<Vec<u8>, ZmtpError> {
    let bad = || protocol("a malformed READY property");
    for _ in 0..MAX_PROPERTIES {
        if data.is_empty() {
            break;
        }
        let (&n, rest) = data.split_first().ok_or_else(bad)?;
        let name = rest.get(..usize::from(n)).ok_or_else(bad)?;
        let rest = &rest[usize::from(n)..];
        let len_bytes: [u8; 4] = rest
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(bad)?;
        let len = usize::try_from(u32::from_be_bytes(len_bytes)).map_err(|_| bad())?;
        let value = rest.get(4..4usize.saturating_add(len)).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(value.to_vec());
        }
        data = &rest[4 + len..];
    }
    Err(protocol("READY names no Socket-Type"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_properties_are_bounds_checked() {
        let mut ok = Vec::new();
        put_property(&mut ok, b"Identity", b"x");
        put_property(&mut ok, b"Socket-Type", b"PUB");
        assert_eq!(ready_socket_type(&ok).unwrap(), b"PUB");
        // A value length past the end, a name past the end, no socket type.
        let mut long = vec![11];
        long.extend_from_slice(b"Socket-Type");
        long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(ready_socket_type(&long).is_err());
        assert!(ready_socket_type(&[200, b'a']).is_err());
        assert!(ready_socket_type(&[]).is_err());
        assert!(command_parts(&[9, b'P']).is_err());
        assert!(command_parts(&[]).is_err());
    }

    /// A peer that completes the handshake as PUB, then sends one 100-byte message in two
    /// halves 300 ms apart.
    async fn split_frame_peer(listener: tokio::net::TcpListener) {
        let (mut s, _) = listener.accept().await.unwrap();
        handshake_as_pub(&mut s).await;
        let mut frame = vec![0x00, 100];
        frame.extend((0..100).map(|i| i as u8));
        s.write_all(&frame[..50]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(&frame[50..]).await.unwrap();
        // Keep the connection open while the client reads.
        let mut sink = [0u8; 1024];
        while s.read(&mut sink).await.unwrap_or(0) > 0 {}
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A SUB connection to `addr`, subscribed to everything.
    async fn subscribed(addr: &str) -> Zmtp {
        let limits = Limits {
            max_frame: 1 << 20,
            max_parts: 4,
            max_frame_time: Duration::from_secs(30),
        };
        let mut z = Zmtp::connect(addr, SocketType::Sub, limits).await.unwrap();
        z.subscribe(b"").await.unwrap();
        z
    }

    /// [`Zmtp::recv`] (idle `idle`), cancelled by a timer every `period` and called again, as
    /// the feed's refresh tick does, until it gives an answer.
    async fn recv_cancelled_every(
        z: &mut Zmtp,
        period: Duration,
        idle: Duration,
    ) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            tokio::select! {
                r = z.recv(idle) => break r,
                _ = tokio::time::sleep(period) => {}
            }
        }
    }

    /// The PUB side of a handshake on `s`.
    async fn handshake_as_pub(s: &mut tokio::net::TcpStream) {
        s.write_all(&greeting()).await.unwrap();
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        put_property(&mut ready, b"Socket-Type", b"PUB");
        s.write_all(&[0x04, ready.len() as u8]).await.unwrap();
        s.write_all(&ready).await.unwrap();
    }

    /// A peer that trickles a frame a byte at a time is alive by every other measure (each
    /// byte resets the idle timer, so it is never pinged); the frame's bound gives it up.
    /// Before, the 100-byte frame below took 20 s and its residency stayed recorded meanwhile.
    #[test]
    fn a_frame_trickled_past_its_time_is_given_up() {
        runtime().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                handshake_as_pub(&mut s).await;
                s.write_all(&[0x00, 100]).await.unwrap();
                for i in 0..100u8 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if s.write_all(&[i]).await.is_err() {
                        return;
                    }
                }
            });
            let limits = Limits {
                max_frame: 1 << 20,
                max_parts: 4,
                max_frame_time: Duration::from_secs(1),
            };
            let mut z = Zmtp::connect(&addr, SocketType::Sub, limits).await.unwrap();
            z.subscribe(b"").await.unwrap();
            let got =
                tokio::time::timeout(Duration::from_secs(60), z.recv(Duration::from_secs(60)))
                    .await
                    .expect("recv neither gave up nor returned");
            match got {
                Err(ZmtpError::Timeout(why)) => assert!(why.contains("frame"), "{why}"),
                other => panic!("expected the frame's timeout, got {other:?}"),
            }
        });
    }

    /// What a peer says of itself goes into the error (logged at every reconnect) quoted,
    /// escaped and cut: an ERROR's reason is its length byte's worth, not the whole command,
    /// and a multi-megabyte command name or socket type shows as its first bytes.
    #[test]
    fn a_peers_words_reach_the_error_short_and_escaped() {
        let refused = |reason: &[u8], trailer: &[u8], name: &[u8], socket: &[u8]| {
            runtime().block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap().to_string();
                let (reason, trailer, name, socket) = (
                    reason.to_vec(),
                    trailer.to_vec(),
                    name.to_vec(),
                    socket.to_vec(),
                );
                tokio::spawn(async move {
                    let (mut s, _) = listener.accept().await.unwrap();
                    s.write_all(&greeting()).await.unwrap();
                    let mut cmd = vec![name.len() as u8];
                    cmd.extend_from_slice(&name);
                    if name == b"ERROR" {
                        cmd.push(reason.len() as u8);
                        cmd.extend_from_slice(&reason);
                        cmd.extend_from_slice(&trailer);
                    } else {
                        put_property(&mut cmd, b"Socket-Type", &socket);
                    }
                    s.write_all(&[0x06]).await.unwrap();
                    s.write_all(&(cmd.len() as u64).to_be_bytes())
                        .await
                        .unwrap();
                    s.write_all(&cmd).await.unwrap();
                    let mut sink = [0u8; 1024];
                    while s.read(&mut sink).await.unwrap_or(0) > 0 {}
                });
                let limits = Limits {
                    max_frame: 1 << 20,
                    max_parts: 4,
                    max_frame_time: Duration::from_secs(30),
                };
                match Zmtp::connect(&addr, SocketType::Sub, limits).await {
                    Err(e) => e.to_string(),
                    Ok(_) => panic!("the handshake succeeded"),
                }
            })
        };
        let long = b"line one\nline two ".repeat(40);
        let e = refused(&long[..255], &[b'x'; 4096], b"ERROR", b"");
        assert!(
            e.starts_with("protocol: the peer refused: \"line one\\nline two"),
            "{e}"
        );
        assert!(!e.contains('\n') && !e.contains('x'), "{e}");
        assert!(e.len() < 2 * MAX_QUOTED + 60, "{} bytes: {e}", e.len());
        let e = refused(b"", b"", b"READY", &[b'\r'; 100_000]);
        assert!(e.contains("the peer is a \"\\r\\r"), "{e}");
        assert!(
            !e.contains('\r') && e.len() < 4 * MAX_QUOTED + 80,
            "{} bytes: {e}",
            e.len()
        );
        let e = refused(b"", b"", b"NOPE\n", b"");
        assert!(e.contains("got \"NOPE\\n\""), "{e}");
    }

    #[test]
    fn a_peer_that_pings_and_reads_nothing_is_given_up() {
        runtime().block_on(async {
            // A small receive buffer, so that the pongs back up soon.
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.set_recv_buffer_size(4096).unwrap();
            socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let listener = socket.listen(1).unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let peer = tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                handshake_as_pub(&mut s).await;
                // The client's greeting, READY and SUBSCRIBE are never read either.
                let pings = b"\x04\x07\x04PING\x00\x00".repeat(8192);
                let mut sent = 0usize;
                while s.write_all(&pings).await.is_ok() {
                    sent += pings.len();
                }
                sent
            });
            let mut z = subscribed(&addr).await;
            // Before, the pong that did not fit blocked `recv` for good; the test's own
            // deadline only tells a hang from an answer.
            let got = tokio::time::timeout(
                Duration::from_secs(120),
                recv_cancelled_every(&mut z, Duration::from_millis(20), Duration::from_secs(60)),
            )
            .await
            .expect("recv never gave up on a peer that reads nothing");
            match got {
                Err(ZmtpError::Timeout(why)) => assert_eq!(why, "the peer reads nothing"),
                other => panic!("expected a write timeout, got {other:?}"),
            }
            assert!(z.out.len() >= MAX_UNSENT, "{} bytes queued", z.out.len());
            drop(z);
            // The peer got far enough to fill every buffer between the two.
            assert!(peer.await.unwrap() > 0);
        });
    }

    #[test]
    fn pings_are_answered_whole_under_cancellation() {
        runtime().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let peer = tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                handshake_as_pub(&mut s).await;
                // The client's greeting, READY (2 + its length) and SUBSCRIBE (2 + 10).
                let mut greeting = [0u8; 64];
                s.read_exact(&mut greeting).await.unwrap();
                let mut head = [0u8; 2];
                s.read_exact(&mut head).await.unwrap();
                let mut skip = vec![0u8; usize::from(head[1]) + 12];
                s.read_exact(&mut skip).await.unwrap();
                // 2,000 pings, each with its own context, then one message.
                for i in 0..2000u16 {
                    let mut ping = vec![0x04, 9];
                    ping.extend_from_slice(b"\x04PING\x00\x00");
                    ping.extend_from_slice(&i.to_be_bytes());
                    s.write_all(&ping).await.unwrap();
                }
                s.write_all(&[0x00, 2, b'o', b'k']).await.unwrap();
                // Every pong, whole and in order: flags, size, name, context.
                for i in 0..2000u16 {
                    let mut pong = [0u8; 9];
                    s.read_exact(&mut pong).await.unwrap();
                    assert_eq!(&pong[..7], b"\x04\x07\x04PONG", "pong {i}");
                    assert_eq!(pong[7..], i.to_be_bytes(), "pong {i}");
                }
            });
            let mut z = subscribed(&addr).await;
            let msg =
                recv_cancelled_every(&mut z, Duration::from_micros(200), Duration::from_secs(10))
                    .await
                    .unwrap();
            assert_eq!(msg, vec![Bytes::from_static(b"ok")]);
            // The pongs still queued go out with the next calls (which end when the peer
            // closes).
            let checked = tokio::time::timeout(Duration::from_secs(60), async {
                while z.recv(Duration::from_secs(10)).await.is_ok() {}
                peer.await
            })
            .await;
            checked.expect("the pongs never all arrived").unwrap();
        });
    }

    #[test]
    fn a_frame_split_across_a_cancelled_read_arrives_whole() {
        runtime().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            tokio::spawn(split_frame_peer(listener));
            let mut z = subscribed(&addr).await;
            let msg =
                recv_cancelled_every(&mut z, Duration::from_millis(50), Duration::from_secs(10))
                    .await
                    .unwrap();
            assert_eq!(msg.len(), 1);
            assert_eq!(
                msg[0].as_ref(),
                (0..100).map(|i| i as u8).collect::<Vec<_>>()
            );
        });
    }
}
