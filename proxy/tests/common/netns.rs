//! A network namespace made by a test, joined to the host by a veth pair: processes run inside
//! it by `ip netns exec`, and cutting the host's end of the pair partitions them from everything
//! outside (needs root, as CI has; `ip` from iproute2).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::Ipv4Addr;
use std::process::Command;

/// The namespace and its link; both removed on drop.
pub struct Netns {
    /// The namespace's name.
    pub name: String,
    host_link: String,
    /// The host's address on the link (reachable from inside).
    pub host_ip: Ipv4Addr,
    /// The namespace's address on the link (reachable from the host).
    pub inside_ip: Ipv4Addr,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Netns {
    /// A fresh namespace, with `lo` up and a /30 to the host. Needs root.
    pub fn new() -> Netns {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        assert!(
            root,
            "this test makes a network namespace: run it as root (CI does), with iproute2"
        );
        // Unique names: a random tag, retried while taken (another job on the host).
        let (tag, name) = loop {
            let tag = fastrand::u32(..0x10_0000);
            let name = format!("kvmesh-test-{tag:05x}");
            let added = Command::new("ip").args(["netns", "add", &name]).output();
            if added.is_ok_and(|o| o.status.success()) {
                break (tag, name);
            }
        };
        let host_link = format!("kvp{tag:05x}h");
        let inside_link = format!("kvp{tag:05x}n");
        let [_, _, hi, lo] = tag.to_be_bytes();
        let third = hi.wrapping_add(lo);
        let host_ip = Ipv4Addr::new(10, 213, third, 1);
        let inside_ip = Ipv4Addr::new(10, 213, third, 2);
        let ns = Netns {
            name,
            host_link,
            host_ip,
            inside_ip,
        };
        ip(&[
            "link",
            "add",
            &ns.host_link,
            "type",
            "veth",
            "peer",
            "name",
            &inside_link,
        ]);
        ip(&["link", "set", &inside_link, "netns", &ns.name]);
        ip(&[
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &ns.host_link,
        ]);
        ip(&["link", "set", &ns.host_link, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&[
            "addr",
            "add",
            &format!("{inside_ip}/30"),
            "dev",
            &inside_link,
        ]);
        inside(&["link", "set", &inside_link, "up"]);
        inside(&["link", "set", "lo", "up"]);
        // While the link is down its route is gone: without this, packets for the namespace
        // would follow the host's default route out of the machine.
        ip(&["route", "add", "blackhole", &ns.subnet(), "metric", "4000"]);
        ns
    }

    fn subnet(&self) -> String {
        let [a, b, c, _] = self.host_ip.octets();
        format!("{a}.{b}.{c}.0/30")
    }

    /// A command that runs `program` inside the namespace.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Cuts the link (`false`) or restores it (`true`): both directions, every protocol.
    pub fn set_link(&self, up: bool) {
        ip(&[
            "link",
            "set",
            &self.host_link,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["route", "del", "blackhole", &self.subnet()])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_link])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
