//! The credentials of the process behind a FUSE request, as the core's setuid/setgid rules
//! ([`cetrafs_core::fs::Credentials`]) ask for them.
//!
//! A FUSE request carries the caller's fsuid, fsgid and thread id, nothing more. What else
//! the rules need is read from `/proc/<tid>/status` — only when asked, which the core does
//! only for a file that has a setuid or setgid bit:
//! * `CAP_FSETID`: the `CapEff` mask, counted only for a caller in this daemon's user namespace
//!   (the kernel's FUSE asks `capable(CAP_FSETID)` in the initial namespace when it flags a
//!   write, and this is the same test);
//! * group membership: the fsgid, else the `Groups` list.
//!
//! If the caller is gone or its status is unreadable it is treated as unprivileged and in no
//! extra group: the bits are removed rather than kept.

use cetrafs_core::fs::Credentials;
use std::cell::OnceCell;

/// Bit of `CAP_FSETID` in the capability masks (linux/capability.h).
const CAP_FSETID: u32 = 4;

/// What `/proc/<tid>/status` says about the caller.
#[derive(Debug, Default)]
struct Status {
    fsetid: bool,
    groups: Vec<u32>,
}

#[derive(Debug)]
pub struct RequestCreds {
    pid: u32,
    uid: u32,
    gid: u32,
    /// Set when the request itself says (`FUSE_WRITE_KILL_SUIDGID`: the caller lacks it).
    fsetid: Option<bool>,
    status: OnceCell<Status>,
}

impl RequestCreds {
    pub fn new(pid: u32, uid: u32, gid: u32) -> Self {
        Self {
            pid,
            uid,
            gid,
            fsetid: None,
            status: OnceCell::new(),
        }
    }

    /// The kernel has already decided whether the caller holds `CAP_FSETID`.
    pub fn with_fsetid(mut self, has: bool) -> Self {
        self.fsetid = Some(has);
        self
    }

    fn status(&self) -> &Status {
        self.status.get_or_init(|| read_status(self.pid, self.uid))
    }
}

impl Credentials for RequestCreds {
    fn has_fsetid(&self) -> bool {
        self.fsetid.unwrap_or_else(|| self.status().fsetid)
    }
    fn in_group(&self, gid: u32) -> bool {
        gid == self.gid || self.status().groups.contains(&gid)
    }
}

fn read_status(pid: u32, uid: u32) -> Status {
    // pid 0: a request the kernel makes on its own behalf.
    if pid == 0 {
        return Status {
            fsetid: uid == 0,
            groups: Vec::new(),
        };
    }
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Status::default();
    };
    let same_userns = match (
        std::fs::read_link(format!("/proc/{pid}/ns/user")),
        std::fs::read_link("/proc/self/ns/user"),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    parse_status(&text, same_userns)
}

fn parse_status(text: &str, same_userns: bool) -> Status {
    let mut st = Status::default();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("CapEff:") {
            let caps = u64::from_str_radix(v.trim(), 16).unwrap_or(0);
            st.fsetid = same_userns && caps & (1 << CAP_FSETID) != 0;
        } else if let Some(v) = line.strip_prefix("Groups:") {
            st.groups = v
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect();
        }
    }
    st
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_caps_and_groups() {
        let text = "Name:\tsh\nGroups:\t4 24 100 \nCapEff:\t000001ffffffffff\n";
        let s = parse_status(text, true);
        assert!(s.fsetid);
        assert_eq!(s.groups, [4, 24, 100]);
        assert!(!parse_status(text, false).fsetid, "other user namespace");
        let s = parse_status("Groups:\nCapEff:\t0000000000000000\n", true);
        assert!(!s.fsetid && s.groups.is_empty());
    }

    #[test]
    fn this_process_is_readable_and_unknown_pids_are_unprivileged() {
        let me = RequestCreds::new(std::process::id(), 0, 12345);
        assert!(me.in_group(12345));
        // The answer about ourselves must agree with /proc/self.
        let own = std::fs::read_to_string("/proc/self/status").unwrap();
        assert_eq!(me.has_fsetid(), parse_status(&own, true).fsetid);
        let gone = RequestCreds::new(u32::MAX - 1, 1000, 1000);
        assert!(!gone.has_fsetid() && !gone.in_group(0));
        let told = RequestCreds::new(u32::MAX - 1, 1000, 1000).with_fsetid(true);
        assert!(told.has_fsetid());
    }
}
