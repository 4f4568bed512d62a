//! Soak: a steady open-loop rate, for a long time, through a kvmesh gateway and two kvmesh
//! sidecars (gossiping) in front of simulated engines, sampling each proxy's resident memory,
//! open file descriptors, residency index and requests in flight, and judging whether they
//! stay bounded. Half the requests continue one of a few conversations (shared prefixes, cache
//! hits), half are fresh prompts (new digests), so the residency index reaches its cap early and
//! has to stay there; a third are streamed.

use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde::Serialize;

use crate::load::{self, HttpClient};
use crate::procs::{self, Proc};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// How long the load runs.
    pub duration: Duration,
    /// Requests per second, spread over the three proxies.
    pub rate: f64,
    /// How often the proxies are sampled.
    pub sample_every: Duration,
    /// `residency.capacity_per_node` of every proxy (small, so the cap is reached early).
    pub capacity_per_node: usize,
}

/// One proxy at one moment.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Reading {
    /// Resident set, KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Digests in its residency index (`kvmesh_residency_index_digests`).
    pub digests: u64,
    /// Requests in flight (`kvmesh_inflight_requests`).
    pub inflight: u64,
}

/// All proxies at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t_secs: f64,
    /// Requests sent so far, and failed so far.
    pub sent: u64,
    /// (see `sent`)
    pub failed: u64,
    /// One reading per proxy, in [`SoakReport::proxies`] order.
    pub readings: Vec<Reading>,
}

/// What one proxy did over the run, and the verdict.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyVerdict {
    /// `gateway`, `sidecar-0`, `sidecar-1`.
    pub name: String,
    /// RSS at the end of the warm-up (the first quarter, at least a minute of a short run) and
    /// at the end, KiB.
    pub rss_start_kib: u64,
    /// (see `rss_start_kib`)
    pub rss_end_kib: u64,
    /// Largest RSS after the warm-up, KiB.
    pub rss_max_kib: u64,
    /// Least-squares slope of RSS after the warm-up, KiB per minute.
    pub rss_slope_kib_per_min: f64,
    /// Open fds at the end of the warm-up, largest after it, at the end.
    pub fds_start: u64,
    /// (see `fds_start`)
    pub fds_max: u64,
    /// (see `fds_start`)
    pub fds_end: u64,
    /// Least-squares slope of open fds after the warm-up, per minute.
    pub fds_slope_per_min: f64,
    /// Largest residency index seen, digests, and its bound (cap x engines it can know; held
    /// exactly at rest, with up to a lock chunk more per write in progress while loaded).
    pub digests_max: u64,
    /// (see `digests_max`)
    pub digests_bound: u64,
    /// Requests in flight once the load has stopped and drained.
    pub inflight_after: u64,
    /// Every check passed.
    pub bounded: bool,
    /// Why not, when not.
    pub problems: Vec<String>,
}

/// The soak's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// Proxy names, in reading order.
    pub proxies: Vec<String>,
    /// Requests sent, and failed (non-2xx or transport error).
    pub sent: u64,
    /// (see `sent`)
    pub failed: u64,
    /// The samples.
    pub samples: Vec<Sample>,
    /// Per-proxy verdicts.
    pub verdicts: Vec<ProxyVerdict>,
}

impl SoakReport {
    /// Whether nothing failed and every proxy stayed bounded.
    pub fn passed(&self) -> bool {
        self.failed == 0 && self.verdicts.iter().all(|v| v.bounded)
    }
}

/// RSS (KiB) and open fds of process `pid`, from `/proc`.
fn proc_reading(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no VmRSS")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("reading /proc/{pid}/fd"))?
        .count() as u64;
    Ok((rss, fds))
}

/// The value of an unlabelled sample `name` in a Prometheus exposition.
fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// One reading of proxy `name`; an error names it (a proxy that died, or hangs, fails the soak).
async fn read(client: &HttpClient, name: &str, p: &Proc) -> anyhow::Result<Reading> {
    let (rss_kib, fds) = proc_reading(p.pid()).with_context(|| format!("{name} (did it die?)"))?;
    let text = procs::metrics_text(client, p.addr)
        .await
        .with_context(|| name.to_string())?;
    let get = |m: &str| metric(&text, m).with_context(|| format!("{name}: no {m} in /metrics"));
    Ok(Reading {
        rss_kib,
        fds,
        digests: get("kvmesh_residency_index_digests")?,
        inflight: get("kvmesh_inflight_requests")?,
    })
}

/// Longest one request may take before it counts as failed (a hung proxy fails the soak
/// rather than hanging it).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Least-squares slope of `ys` over `xs` (per unit of x); 0 with fewer than two points.
pub fn slope(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len().min(ys.len());
    if n < 2 {
        return 0.0;
    }
    let (mx, my) = (
        xs[..n].iter().sum::<f64>() / n as f64,
        ys[..n].iter().sum::<f64>() / n as f64,
    );
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for i in 0..n {
        sxy += (xs[i] - mx) * (ys[i] - my);
        sxx += (xs[i] - mx) * (xs[i] - mx);
    }
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// Request `i`'s body: a turn of one of 8 conversations (even `i`) or a fresh 4 KB prompt (odd);
/// every third streamed.
fn body(i: u64) -> Bytes {
    let content = if i.is_multiple_of(2) {
        let conv = (i / 2) % 8;
        format!("{} turn {}", load::text(conv, 3000), i / 16)
    } else {
        load::text(1_000_000 + i, 4096)
    };
    let v = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": i.is_multiple_of(3),
    });
    Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
}

/// Judges one proxy's readings (`t` in seconds, `after` the index of the first reading past
/// the warm-up) against the bounds a steady state allows.
pub fn judge(
    name: &str,
    t: &[f64],
    r: &[Reading],
    after: usize,
    digests_bound: u64,
    drained: Reading,
) -> ProxyVerdict {
    let inflight_after = drained.inflight;
    let post = &r[after.min(r.len().saturating_sub(1))..];
    let tp = &t[after.min(t.len().saturating_sub(1))..];
    let minutes: Vec<f64> = tp.iter().map(|s| s / 60.0).collect();
    let rss: Vec<f64> = post.iter().map(|x| x.rss_kib as f64).collect();
    let fds: Vec<f64> = post.iter().map(|x| x.fds as f64).collect();
    let first = post.first().copied().unwrap_or(Reading {
        rss_kib: 0,
        fds: 0,
        digests: 0,
        inflight: 0,
    });
    let last = post.last().copied().unwrap_or(first);
    let rss_slope = slope(&minutes, &rss);
    let fds_slope = slope(&minutes, &fds);
    let span_min = minutes.last().unwrap_or(&0.0) - minutes.first().unwrap_or(&0.0);
    let mut problems = Vec::new();
    // Growth the trend projects over the measured span: allocator noise and caches filling
    // stay under 8 MiB (12 MiB over less than 5 minutes) or 10% of the start; a steady leak
    // does not, once it adds up to more (in the 2-minute run, about 15 KiB per request; in 30
    // minutes, a few hundred bytes).
    // Over a short span a few MiB of allocator noise dominate the slope: more room there.
    let projected = rss_slope * span_min;
    let floor_mib = if span_min < 5.0 { 12.0 } else { 8.0 };
    let allowed = (floor_mib * 1024.0_f64).max(first.rss_kib as f64 * 0.10);
    if projected > allowed {
        problems.push(format!(
            "RSS grows {rss_slope:.0} KiB/min ({projected:.0} KiB over {span_min:.1} min, more than {allowed:.0})"
        ));
    }
    // Pooled connections come and go with the load; a leak of one per request does not.
    if fds_slope * span_min > 16.0 {
        problems.push(format!(
            "open fds grow {fds_slope:.1}/min ({} -> {})",
            first.fds, last.fds
        ));
    }
    // A write lands in the index before its node's LRU is trimmed back to the cap, one chunk
    // at a time: a reading taken meanwhile may see up to a chunk more per write in progress.
    // At rest, the bound holds exactly.
    let digests_max = r.iter().map(|x| x.digests).max().unwrap_or(0);
    let in_flight_slack = 4 * kvmesh_filters::residency::LOCK_CHUNK as u64;
    if digests_max > digests_bound + in_flight_slack {
        problems.push(format!(
            "residency index reached {digests_max} digests, above its bound {digests_bound} (+{in_flight_slack} for writes in progress)"
        ));
    }
    if drained.digests > digests_bound {
        problems.push(format!(
            "residency index holds {} digests at rest, above its bound {digests_bound}",
            drained.digests
        ));
    }
    if inflight_after != 0 {
        problems.push(format!(
            "{inflight_after} requests still counted in flight after the load"
        ));
    }
    ProxyVerdict {
        name: name.to_string(),
        rss_start_kib: first.rss_kib,
        rss_end_kib: last.rss_kib,
        rss_max_kib: post.iter().map(|x| x.rss_kib).max().unwrap_or(0),
        rss_slope_kib_per_min: rss_slope,
        fds_start: first.fds,
        fds_max: post.iter().map(|x| x.fds).max().unwrap_or(0),
        fds_end: last.fds,
        fds_slope_per_min: fds_slope,
        digests_max,
        digests_bound,
        inflight_after,
        bounded: problems.is_empty(),
        problems,
    }
}

/// Runs the soak: 4 sim engines, a gateway in front of two, a sidecar beside each of the other
/// two; `cfg.rate` requests/s spread round-robin over the three proxies.
pub async fn run(cfg: &SoakConfig) -> anyhow::Result<SoakReport> {
    let sim_args: Vec<String> = vec!["--cache-blocks".into(), "2048".into()];
    let sims = (0..4)
        .map(|i| procs::sim(&format!("engine-{i}"), &sim_args))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let residency = format!(
        "[residency]\ncapacity_per_node = {}\n",
        cfg.capacity_per_node
    );
    let gateway = procs::kvmesh_with(
        "prefix",
        &[sims[0].addr, sims[1].addr],
        2,
        1000,
        None,
        &residency,
    )
    .await?;
    let sidecars =
        procs::kvmesh_sidecars_with(&[sims[2].addr, sims[3].addr], "home", &residency, "").await?;
    let proxies: Vec<(&str, &Proc)> = vec![
        ("gateway", &gateway),
        ("sidecar-0", &sidecars[0]),
        ("sidecar-1", &sidecars[1]),
    ];
    // The gateway's index knows its 2 engines; a sidecar its own engine and its peer's.
    let bound = 2 * cfg.capacity_per_node as u64;
    let urls: Vec<String> = proxies
        .iter()
        .map(|(_, p)| format!("http://{}/v1/chat/completions", p.addr))
        .collect();
    let client = load::client(256);
    let probe = load::client(4);
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let start = Instant::now();
    let every = Duration::from_secs_f64(1.0 / cfg.rate.max(0.1));
    let driver = {
        let (sent, failed, client) = (sent.clone(), failed.clone(), client.clone());
        let (duration, urls) = (cfg.duration, urls.clone());
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = 0u64;
            while start.elapsed() < duration {
                tick.tick().await;
                let (client, url, failed) = (
                    client.clone(),
                    urls[(i % urls.len() as u64) as usize].clone(),
                    failed.clone(),
                );
                let b = body(i);
                tasks.spawn(async move {
                    let ok = tokio::time::timeout(REQUEST_TIMEOUT, load::send(&client, &url, b))
                        .await
                        .is_ok_and(|s| (200..300).contains(&s.status));
                    if !ok {
                        failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                i += 1;
                // Reap finished ones so the set stays small.
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        })
    };
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(cfg.sample_every);
    loop {
        tick.tick().await;
        let mut readings = Vec::new();
        for (name, p) in &proxies {
            readings.push(read(&probe, name, p).await?);
        }
        let s = Sample {
            t_secs: start.elapsed().as_secs_f64(),
            sent: sent.load(std::sync::atomic::Ordering::Relaxed),
            failed: failed.load(std::sync::atomic::Ordering::Relaxed),
            readings,
        };
        eprintln!(
            "  [{:>6.0}s] sent {} failed {} | {}",
            s.t_secs,
            s.sent,
            s.failed,
            s.readings
                .iter()
                .map(|r| format!(
                    "rss {} MiB fds {} digests {}",
                    r.rss_kib / 1024,
                    r.fds,
                    r.digests
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        samples.push(s);
        if start.elapsed() >= cfg.duration {
            break;
        }
    }
    driver.await.context("the load driver stopped")?;
    // Drained: nothing may still count as in flight.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut after = Vec::new();
    for (name, p) in &proxies {
        after.push(read(&probe, name, p).await?);
    }
    let t: Vec<f64> = samples.iter().map(|s| s.t_secs).collect();
    // The warm-up: the first quarter, and at least a minute of a short run (allocator
    // arenas, pooled connections and gossip state are still growing then).
    let total = cfg.duration.as_secs_f64();
    let warm_secs = (total / 4.0).max(60.0_f64.min(total / 2.0));
    let warm = samples
        .iter()
        .position(|s| s.t_secs >= warm_secs)
        .unwrap_or(0);
    let verdicts = proxies
        .iter()
        .enumerate()
        .map(|(k, (name, _))| {
            let r: Vec<Reading> = samples.iter().map(|s| s.readings[k]).collect();
            judge(name, &t, &r, warm, bound, after[k])
        })
        .collect();
    Ok(SoakReport {
        proxies: proxies.iter().map(|(n, _)| n.to_string()).collect(),
        sent: sent.load(std::sync::atomic::Ordering::Relaxed),
        failed: failed.load(std::sync::atomic::Ordering::Relaxed),
        samples,
        verdicts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readings(rss: &[u64]) -> Vec<Reading> {
        rss.iter()
            .map(|&r| Reading {
                rss_kib: r,
                fds: 30,
                digests: 100,
                inflight: 0,
            })
            .collect()
    }

    fn at_rest(digests: u64, inflight: u64) -> Reading {
        Reading {
            rss_kib: 0,
            fds: 0,
            digests,
            inflight,
        }
    }

    #[test]
    fn slope_is_least_squares() {
        assert!((slope(&[0.0, 1.0, 2.0], &[1.0, 3.0, 5.0]) - 2.0).abs() < 1e-12);
        assert_eq!(slope(&[1.0], &[1.0]), 0.0);
        assert_eq!(slope(&[1.0, 1.0], &[1.0, 2.0]), 0.0);
    }

    /// A flat trace passes; one that grows 1 MiB a minute for 30 minutes does not; nor does a
    /// residency index past its bound or a request left in flight.
    #[test]
    fn growth_and_overruns_are_found() {
        let t: Vec<f64> = (0..31).map(|m| m as f64 * 60.0).collect();
        let flat: Vec<u64> = (0..31).map(|m| 50_000 + (m % 3) * 500).collect();
        assert!(judge("p", &t, &readings(&flat), 5, 1000, at_rest(100, 0)).bounded);
        let leak: Vec<u64> = (0..31).map(|m| 50_000 + m * 1024).collect();
        let v = judge("p", &t, &readings(&leak), 5, 1000, at_rest(100, 0));
        assert!(!v.bounded && v.problems[0].contains("RSS grows"), "{v:?}");
        assert!((v.rss_slope_kib_per_min - 1024.0).abs() < 1e-6);
        // Past the bound at rest; far past it under load; a request left in flight.
        assert!(!judge("p", &t, &readings(&flat), 5, 99, at_rest(100, 0)).bounded);
        assert!(judge("p", &t, &readings(&flat), 5, 99, at_rest(99, 0)).bounded);
        assert!(!judge("p", &t, &readings(&flat), 5, 1000, at_rest(100, 1)).bounded);
    }
}
