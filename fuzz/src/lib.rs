//! Shared by every fuzz target: the allocator that makes an over-allocation a finding.
//!
//! libFuzzer's `-malloc_limit_mb` needs a sanitizer's allocator hooks, which these builds
//! (`-s none`) lack, and `-rss_limit_mb` only sees memory that was touched: a
//! `Vec::with_capacity` sized by a hostile count would pass unseen. Capping every byte
//! allocated makes such a reservation fail, and the failed allocation aborts the target, which
//! libFuzzer reports as a crash with the input that did it.

use std::alloc::System;

use cap::Cap;

/// Bytes live at once, in all, before an allocation fails: 4096 times the largest input
/// (`-max_len` is 64 KiB), far above what a parser whose memory is bounded by its input needs.
pub const ALLOCATION_LIMIT: usize = 256 << 20;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, ALLOCATION_LIMIT);
