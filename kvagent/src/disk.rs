//! The SSD tier's on-disk format: one file per block, written atomically.
//!
//! A block file is `blocks/<64 hex digits>.kvb`:
//!
//! ```text
//! magic "KVMBLK01" | digest (32) | token_count u32 LE | model_len u16 LE | payload_len u64 LE
//! | model | payload | BLAKE3 of every byte before it (32)
//! ```
//!
//! A file is written under `tmp/`, fsynced, renamed into `blocks/`, and the directory fsynced, so a
//! crash leaves either the whole file or none under `blocks/` (files left in `tmp/` are removed at
//! start). The trailing checksum covers header and payload, so a truncated or bit-flipped file is
//! detected when it is read and never served. At start only the header and the length are checked
//! (cheap); the checksum is checked on every read.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use kvmesh_filters::chain::Digest;

const MAGIC: &[u8; 8] = b"KVMBLK01";
const HEADER: usize = 8 + 32 + 4 + 2 + 8;
const TRAILER: usize = 32;
const EXT: &str = "kvb";

/// Why a block file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file is truncated, has a bad header, or fails its checksum.
    #[error("corrupt block file {path}: {why}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        why: &'static str,
    },
    /// The file system failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl DiskError {
    fn io(path: &Path, source: io::Error) -> Self {
        DiskError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Bytes the block file of a block with a `model_len`-byte model name and a `payload_len`-byte
/// payload occupies: header, model, payload and checksum (before file-system rounding).
pub fn file_len(model_len: usize, payload_len: u64) -> u64 {
    ((HEADER + TRAILER + model_len) as u64).saturating_add(payload_len)
}

/// A block as stored.
#[derive(Debug, Clone)]
pub struct DiskBlock {
    /// Model the block belongs to.
    pub model: String,
    /// Tokens covered.
    pub token_count: u32,
    /// The opaque payload.
    pub payload: Bytes,
}

/// What the start-up scan learns about a block file without reading its payload.
#[derive(Debug, Clone)]
pub struct ScannedBlock {
    /// The block's digest (from the header, equal to the file name).
    pub digest: Digest,
    /// Model the block belongs to.
    pub model: String,
    /// Tokens covered.
    pub token_count: u32,
    /// Payload bytes.
    pub size: u64,
    /// Last modification (the last put, spill or touch).
    pub modified: SystemTime,
}

/// Result of scanning the directory at start.
#[derive(Debug, Default)]
pub struct Scan {
    /// Usable blocks.
    pub blocks: Vec<ScannedBlock>,
    /// Files dropped because their header or length was wrong.
    pub corrupt_dropped: u64,
    /// Half-written temporary files removed.
    pub temp_removed: u64,
}

/// The block directory.
#[derive(Debug, Clone)]
pub struct BlockDir {
    blocks: PathBuf,
    tmp: PathBuf,
    fsync: bool,
    /// Largest payload a block file may hold (the agent's `limits.max_block_bytes`).
    max_payload: u64,
}

impl BlockDir {
    /// Opens (creating if needed) `root/blocks` and `root/tmp`; block files whose payload
    /// exceeds `max_payload` are corrupt (only a planted or damaged file can hold one).
    pub fn open(root: &Path, fsync: bool, max_payload: u64) -> Result<Self, DiskError> {
        let blocks = root.join("blocks");
        let tmp = root.join("tmp");
        fs::create_dir_all(&blocks).map_err(|e| DiskError::io(&blocks, e))?;
        fs::create_dir_all(&tmp).map_err(|e| DiskError::io(&tmp, e))?;
        Ok(BlockDir {
            blocks,
            tmp,
            fsync,
            max_payload,
        })
    }

    /// The file that holds `digest`.
    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.blocks.join(format!("{}.{EXT}", digest.to_hex()))
    }

    /// Writes one block atomically: see [`BlockDir::write_batch`].
    pub fn write(
        &self,
        digest: &Digest,
        model: &str,
        token_count: u32,
        payload: &[u8],
    ) -> Result<(), DiskError> {
        self.write_batch(&[(digest, model, token_count, payload)])
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Writes blocks atomically, one after the other: temp file, fsync, rename into `blocks/`;
    /// then one directory fsync for the batch. One result per block, in order; a failed block
    /// leaves no file behind. (Writing every temp file before the first fsync was measured slower
    /// here: docs/kvagent.md.)
    pub fn write_batch(
        &self,
        blocks: &[(&Digest, &str, u32, &[u8])],
    ) -> Vec<Result<(), DiskError>> {
        let mut results: Vec<Result<(), DiskError>> = blocks
            .iter()
            .map(|(digest, model, tokens, payload)| {
                let (tmp, f) = self.stage(digest, model, *tokens, payload)?;
                let done = (|| {
                    if self.fsync {
                        f.sync_data()?;
                    }
                    drop(f);
                    fs::rename(&tmp, self.path(digest))
                })();
                done.map_err(|e| {
                    let _ = fs::remove_file(&tmp);
                    DiskError::io(&tmp, e)
                })
            })
            .collect();
        if let Err(e) = self.sync_dir() {
            // The renames may not survive a power loss: report the blocks as failed (the files
            // stay; after a crash each is either whole or caught by its checksum).
            let msg = e.to_string();
            for r in results.iter_mut().filter(|r| r.is_ok()) {
                *r = Err(DiskError::io(&self.blocks, io::Error::other(msg.clone())));
            }
        }
        results
    }

    /// Writes a block's bytes to a new temp file, returning it open for the fsync.
    fn stage(
        &self,
        digest: &Digest,
        model: &str,
        token_count: u32,
        payload: &[u8],
    ) -> Result<(PathBuf, File), DiskError> {
        let model_len = u16::try_from(model.len()).map_err(|_| DiskError::Corrupt {
            path: self.path(digest),
            why: "model name longer than 65535 bytes",
        })?;
        let mut header = Vec::with_capacity(HEADER + model.len());
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&digest.0);
        header.extend_from_slice(&token_count.to_le_bytes());
        header.extend_from_slice(&model_len.to_le_bytes());
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        header.extend_from_slice(model.as_bytes());
        let mut hasher = blake3::Hasher::new();
        hasher.update(&header);
        hasher.update(payload);
        let sum = hasher.finalize();

        let tmp = self
            .tmp
            .join(format!("{}.{:016x}", digest.to_hex(), fastrand::u64(..)));
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&header)?;
            f.write_all(payload)?;
            f.write_all(sum.as_bytes())?;
            Ok(f)
        })();
        written.map(|f| (tmp.clone(), f)).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            DiskError::io(&tmp, e)
        })
    }

    /// Makes completed renames durable.
    fn sync_dir(&self) -> Result<(), DiskError> {
        if self.fsync {
            File::open(&self.blocks)
                .and_then(|d| d.sync_all())
                .map_err(|e| DiskError::io(&self.blocks, e))?;
        }
        Ok(())
    }

    /// Reads and verifies the block `digest`. `Ok(None)` when the file does not exist.
    pub fn read(&self, digest: &Digest) -> Result<Option<DiskBlock>, DiskError> {
        let path = self.path(digest);
        let mut buf = Vec::new();
        let max_len = max_file_len(self.max_payload);
        let f = match open_regular(&path, max_len) {
            Ok(f) => f,
            Err(Opened::Missing) => return Ok(None),
            Err(Opened::Io(e)) => return Err(DiskError::io(&path, e)),
            Err(Opened::Refused(why)) => return Err(DiskError::Corrupt { path, why }),
        };
        let read = f.metadata().and_then(|m| {
            // One exact allocation: read_to_end's doubling would copy multi-MB payloads. The
            // length was checked; a file that grows meanwhile is read no further than it.
            let len = m.len().min(max_len);
            buf.reserve_exact(usize::try_from(len).unwrap_or(0));
            f.take(len).read_to_end(&mut buf)
        });
        if let Err(e) = read {
            return Err(DiskError::io(&path, e));
        }
        decode(buf, digest)
            .map(Some)
            .map_err(|why| DiskError::Corrupt { path, why })
    }

    /// Removes a block file; a missing file is not an error.
    pub fn remove(&self, digest: &Digest) -> Result<(), DiskError> {
        let path = self.path(digest);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DiskError::io(&path, e)),
        }
    }

    /// Lists the usable blocks, removing temporary files and files whose header or length is wrong.
    pub fn scan(&self) -> Result<Scan, DiskError> {
        let mut scan = Scan::default();
        for entry in fs::read_dir(&self.tmp).map_err(|e| DiskError::io(&self.tmp, e))? {
            let entry = entry.map_err(|e| DiskError::io(&self.tmp, e))?;
            if fs::remove_file(entry.path()).is_ok() {
                scan.temp_removed += 1;
            }
        }
        for entry in fs::read_dir(&self.blocks).map_err(|e| DiskError::io(&self.blocks, e))? {
            let entry = entry.map_err(|e| DiskError::io(&self.blocks, e))?;
            let path = entry.path();
            match scan_one(&path, self.max_payload) {
                Ok(Some(b)) => scan.blocks.push(b),
                Ok(None) => {}
                Err(why) => {
                    tracing::warn!(path = %path.display(), why, "dropping corrupt block file");
                    let _ = fs::remove_file(&path);
                    scan.corrupt_dropped += 1;
                }
            }
        }
        Ok(scan)
    }
}

/// Decodes and verifies the bytes of the block file named `digest`: header, length, checksum,
/// UTF-8 model name. The error says what was wrong.
pub fn decode(buf: Vec<u8>, digest: &Digest) -> Result<DiskBlock, &'static str> {
    let h = parse_header(&buf).ok_or("bad header")?;
    if h.digest != *digest {
        return Err("digest does not match the file name");
    }
    if h.file_len() != Some(buf.len() as u64) {
        return Err("length does not match the header");
    }
    let body_end = buf.len() - TRAILER;
    if blake3::hash(&buf[..body_end]).as_bytes() != &buf[body_end..] {
        return Err("checksum mismatch");
    }
    let model_start = HEADER;
    let payload_start = model_start + h.model_len;
    let model = std::str::from_utf8(&buf[model_start..payload_start])
        .map_err(|_| "model name is not UTF-8")?
        .to_owned();
    let payload = Bytes::from(buf).slice(payload_start..body_end);
    Ok(DiskBlock {
        model,
        token_count: h.token_count,
        payload,
    })
}

struct Header {
    digest: Digest,
    token_count: u32,
    model_len: usize,
    payload_len: u64,
}

impl Header {
    /// The file's length as the header declares it; `None` when that overflows (a hostile
    /// `payload_len`).
    fn file_len(&self) -> Option<u64> {
        ((HEADER + self.model_len + TRAILER) as u64).checked_add(self.payload_len)
    }
}

fn parse_header(buf: &[u8]) -> Option<Header> {
    if buf.len() < HEADER || &buf[..8] != MAGIC {
        return None;
    }
    let mut digest = [0u8; 32];
    digest.copy_from_slice(&buf[8..40]);
    let token_count = u32::from_le_bytes(buf[40..44].try_into().ok()?);
    let model_len = u16::from_le_bytes(buf[44..46].try_into().ok()?) as usize;
    let payload_len = u64::from_le_bytes(buf[46..54].try_into().ok()?);
    Some(Header {
        digest: Digest(digest),
        token_count,
        model_len,
        payload_len,
    })
}

/// Why a block file was not opened.
enum Opened {
    /// There is none.
    Missing,
    /// The file system failed.
    Io(io::Error),
    /// Not a block file this agent could have written: a link, a FIFO or a device (whose
    /// reads could block forever or never end), or longer than any block may be.
    Refused(&'static str),
}

/// The longest block file a directory whose payloads are at most `max_payload` bytes may hold
/// (with the longest model name a header can give).
fn max_file_len(max_payload: u64) -> u64 {
    file_len(usize::from(u16::MAX), max_payload)
}

/// Opens `path` for reading if it is a regular file (not followed if a link) of at most
/// `max_len` bytes: checked before opening, so that a FIFO is never opened (that would block),
/// and again on the opened file. A link or FIFO swapped in between the check and the open is
/// not followed, nor waited on ([`open_no_follow`]).
fn open_regular(path: &Path, max_len: u64) -> Result<File, Opened> {
    let check = |m: &fs::Metadata| {
        if !m.file_type().is_file() {
            Err(Opened::Refused("not a regular file"))
        } else if m.len() > max_len {
            Err(Opened::Refused("longer than any block file may be"))
        } else {
            Ok(())
        }
    };
    let io = |e: io::Error| {
        if e.kind() == io::ErrorKind::NotFound {
            Opened::Missing
        } else {
            Opened::Io(e)
        }
    };
    check(&fs::symlink_metadata(path).map_err(io)?)?;
    let f = open_no_follow(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Opened::Refused("not a regular file")
        } else {
            io(e)
        }
    })?;
    check(&f.metadata().map_err(io)?)?;
    Ok(f)
}

/// Opens `path` read-only without following a final symbolic link (`ELOOP` instead) and
/// without waiting for a writer if it is a FIFO (`O_NONBLOCK`, which reads of a regular file
/// ignore), so that what is opened can then be checked.
fn open_no_follow(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}

/// `Ok(None)`: not a block file (ignored). `Err`: a block file that must be dropped.
fn scan_one(path: &Path, max_payload: u64) -> Result<Option<ScannedBlock>, &'static str> {
    let name = path.file_name().and_then(|n| n.to_str());
    let name_digest = match name.and_then(|n| n.strip_suffix(&format!(".{EXT}"))) {
        Some(stem) => kvmesh_filters::chain::parse_hex(stem).ok_or("file name is not a digest")?,
        None => return Ok(None),
    };
    // Only the name this agent writes (lower-case hex): another spelling of the same digest
    // would be indexed twice and never removed with it.
    if name != Some(format!("{}.{EXT}", name_digest.to_hex()).as_str()) {
        return Err("file name is not the digest's own");
    }
    let mut f = match open_regular(path, max_file_len(max_payload)) {
        Ok(f) => f,
        Err(Opened::Refused(why)) => return Err(why),
        Err(_) => return Err("cannot open"),
    };
    let meta = f.metadata().map_err(|_| "cannot stat")?;
    let mut head = [0u8; HEADER];
    f.read_exact(&mut head).map_err(|_| "truncated header")?;
    let h = parse_header(&head).ok_or("bad header")?;
    if h.digest != name_digest {
        return Err("digest does not match the file name");
    }
    if h.file_len() != Some(meta.len()) {
        return Err("length does not match the header");
    }
    if h.payload_len > max_payload {
        return Err("payload larger than limits.max_block_bytes");
    }
    let mut model = vec![0u8; h.model_len];
    f.read_exact(&mut model)
        .map_err(|_| "truncated model name")?;
    let model = String::from_utf8(model).map_err(|_| "model name is not UTF-8")?;
    Ok(Some(ScannedBlock {
        digest: h.digest,
        model,
        token_count: h.token_count,
        size: h.payload_len,
        modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(i: u8) -> Digest {
        Digest([i; 32])
    }

    /// Files planted in the block directory: a link to an endless device, a FIFO (opening it
    /// would block), a sparse file far longer than any block, a block over the payload limit,
    /// and a copy under an upper-case name. None is read or indexed; the scan drops them, and
    /// the agent's own file stays.
    #[test]
    fn planted_files_are_refused_not_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = BlockDir::open(dir.path(), false, 4096).expect("open");
        d.write(&digest(0xab), "m", 16, &[1; 4096]).expect("write");
        let own = fs::read(d.path(&digest(0xab))).expect("read");
        // A block over the limit, written whole (by an agent with a larger limit).
        BlockDir::open(dir.path(), false, 1 << 20)
            .expect("open")
            .write(&digest(2), "m", 16, &[2; 4097])
            .expect("write");
        std::os::unix::fs::symlink("/dev/zero", d.path(&digest(3))).expect("symlink");
        let fifo = d.path(&digest(4));
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());
        let sparse = File::create(d.path(&digest(5))).expect("create");
        sparse.set_len(1 << 40).expect("a sparse file");
        let upper = d
            .blocks
            .join(format!("{}.{EXT}", digest(1).to_hex().to_uppercase()));
        fs::write(&upper, &own).expect("copy");

        for i in [3, 4, 5] {
            assert!(
                matches!(d.read(&digest(i)), Err(DiskError::Corrupt { .. })),
                "block {i}"
            );
        }
        let scan = d.scan().expect("scan");
        let found: Vec<Digest> = scan.blocks.iter().map(|b| b.digest).collect();
        assert_eq!(found, vec![digest(0xab)]);
        assert_eq!(scan.corrupt_dropped, 5);
        for p in [d.path(&digest(2)), d.path(&digest(3)), fifo, upper] {
            assert!(fs::symlink_metadata(&p).is_err(), "{} stays", p.display());
        }
        assert!(d.read(&digest(0xab)).expect("read").is_some());
    }

    /// The open itself, past the checks before it (a link or FIFO swapped in after them):
    /// a link is not followed, a FIFO does not block, a regular file opens.
    #[test]
    fn the_open_neither_follows_a_link_nor_waits_on_a_fifo() {
        let dir = tempfile::tempdir().expect("tempdir");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/dev/zero", &link).expect("symlink");
        let err = open_no_follow(&link).expect_err("a link is not followed");
        assert_eq!(err.raw_os_error(), Some(libc::ELOOP));
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo runs");
        assert!(made.success());
        // Without O_NONBLOCK this open waits for a writer that never comes.
        let f = open_no_follow(&fifo).expect("a FIFO opens at once");
        assert!(!f.metadata().expect("fstat").file_type().is_file());
        let file = dir.path().join("file");
        fs::write(&file, b"x").expect("write");
        assert!(open_no_follow(&file).is_ok());
    }

    #[test]
    fn round_trip_and_every_kind_of_damage_is_caught() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = BlockDir::open(dir.path(), true, 1 << 20).expect("open");
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        d.write(&digest(1), "m", 16, &payload).expect("write");
        let b = d.read(&digest(1)).expect("read").expect("present");
        assert_eq!((b.model.as_str(), b.token_count), ("m", 16));
        assert_eq!(&b.payload[..], &payload[..]);
        assert!(d.read(&digest(2)).expect("read").is_none());

        // A flipped payload bit fails the checksum on read.
        let path = d.path(&digest(1));
        let mut bytes = fs::read(&path).expect("read file");
        bytes[HEADER + 1 + 500] ^= 1;
        fs::write(&path, &bytes).expect("write file");
        assert!(matches!(
            d.read(&digest(1)),
            Err(DiskError::Corrupt {
                why: "checksum mismatch",
                ..
            })
        ));

        // A truncated file and a leftover temp file are removed by the scan; good files stay.
        d.write(&digest(3), "m", 16, &payload).expect("write");
        let p3 = d.path(&digest(3));
        let full = fs::read(&p3).expect("read");
        fs::write(&p3, &full[..full.len() - 7]).expect("truncate");
        d.write(&digest(4), "m", 16, &payload).expect("write");
        fs::write(d.tmp.join("half.tmp"), b"partial").expect("tmp");
        let scan = d.scan().expect("scan");
        // digest 1 has the right length (only a bit flipped): the scan keeps it, reads catch it.
        let mut kept: Vec<u8> = scan.blocks.iter().map(|b| b.digest.0[0]).collect();
        kept.sort_unstable();
        assert_eq!(kept, vec![1, 4]);
        assert_eq!((scan.corrupt_dropped, scan.temp_removed), (1, 1));
        assert!(!p3.exists());
    }

    /// Fuzzing regression (kvagent_block): a `payload_len` near `u64::MAX` overflowed the
    /// declared file length (a panic in debug builds, a wrapped length in release). Such a file
    /// is corrupt, on read and at the start-up scan.
    #[test]
    fn a_payload_length_that_overflows_is_corrupt_not_a_panic() {
        let mut file = MAGIC.to_vec();
        file.extend_from_slice(&digest(9).0);
        file.extend_from_slice(&16u32.to_le_bytes());
        file.extend_from_slice(&1u16.to_le_bytes());
        file.extend_from_slice(&(u64::MAX - 10).to_le_bytes());
        file.push(b'm');
        let sum = *blake3::hash(&file).as_bytes();
        file.extend_from_slice(&sum);
        assert_eq!(
            decode(file.clone(), &digest(9)).err(),
            Some("length does not match the header")
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let d = BlockDir::open(dir.path(), false, 1 << 20).expect("open");
        fs::write(d.path(&digest(9)), &file).expect("write file");
        assert!(matches!(d.read(&digest(9)), Err(DiskError::Corrupt { .. })));
        let scan = d.scan().expect("scan");
        assert_eq!((scan.blocks.len(), scan.corrupt_dropped), (0, 1));
    }
}
