//! Randomized namespace operations checked against a model of the tree: every operation's
//! result (success or errno) must match what Linux VFS + a correct filesystem would return.
//! Then a full walk is compared with the model, before and after a remount, and fsck -n.
//!
//! Environment: `CETRA_SEED` replays a run, `CETRA_NS_OPS` changes the number of operations.

use cetrafs_tests::{
    cstr, errno_name, list_xattrs, lstat, remove_xattr, require_fuse, secs, seed, set_xattr, Lun,
    Mount,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

const NAMES: [&str; 7] = [
    "a",
    "b",
    "c",
    "dd",
    "e-long-name-with-some-length",
    "f",
    "g",
];
const XATTR_NAMES: [&str; 3] = ["user.one", "user.two", "user.three"];

type Id = usize;
type Errno = i32;

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    File,
    Dir,
    Symlink(String),
}

#[derive(Debug, Clone)]
struct Node {
    kind: Kind,
    /// Directories: entries. Others: empty.
    children: BTreeMap<String, Id>,
    /// Directories: the parent (root: itself).
    parent: Id,
    xattrs: BTreeMap<String, Vec<u8>>,
    content: Vec<u8>,
}

struct Model {
    nodes: Vec<Node>,
}

const ROOT: Id = 0;

fn split(p: &str) -> (&str, &str) {
    match p.rfind('/') {
        Some(i) => (&p[..i], &p[i + 1..]),
        None => ("", p),
    }
}

impl Model {
    fn new() -> Self {
        Self {
            nodes: vec![Node {
                kind: Kind::Dir,
                children: BTreeMap::new(),
                parent: ROOT,
                xattrs: BTreeMap::new(),
                content: Vec::new(),
            }],
        }
    }

    fn is_dir(&self, i: Id) -> bool {
        self.nodes[i].kind == Kind::Dir
    }

    /// Resolve a directory path ("" = root). Intermediate symlinks point nowhere: ENOENT.
    fn resolve_dir(&self, p: &str) -> Result<Id, Errno> {
        let mut cur = ROOT;
        for comp in p.split('/').filter(|c| !c.is_empty()) {
            let next = *self.nodes[cur].children.get(comp).ok_or(libc::ENOENT)?;
            match self.nodes[next].kind {
                Kind::Dir => cur = next,
                Kind::File => return Err(libc::ENOTDIR),
                Kind::Symlink(_) => return Err(libc::ENOENT),
            }
        }
        Ok(cur)
    }

    /// Resolve parent and look up the last component (not following it).
    fn resolve(&self, p: &str) -> Result<(Id, Option<Id>), Errno> {
        let (dir, name) = split(p);
        let d = self.resolve_dir(dir)?;
        Ok((d, self.nodes[d].children.get(name).copied()))
    }

    fn add(&mut self, parent: Id, name: &str, kind: Kind, content: Vec<u8>) -> Id {
        let id = self.nodes.len();
        self.nodes.push(Node {
            kind,
            children: BTreeMap::new(),
            parent,
            xattrs: BTreeMap::new(),
            content,
        });
        self.nodes[parent].children.insert(name.to_string(), id);
        id
    }

    fn create(&mut self, p: &str, kind: Kind, content: Vec<u8>) -> Result<Id, Errno> {
        let (d, existing) = self.resolve(p)?;
        if existing.is_some() {
            return Err(libc::EEXIST);
        }
        Ok(self.add(d, split(p).1, kind, content))
    }

    fn link(&mut self, old: &str, new: &str) -> Result<(), Errno> {
        let (_, o) = self.resolve(old)?;
        let o = o.ok_or(libc::ENOENT)?;
        let (nd, n) = self.resolve(new)?;
        if n.is_some() {
            return Err(libc::EEXIST);
        }
        if self.is_dir(o) {
            return Err(libc::EPERM);
        }
        self.nodes[nd].children.insert(split(new).1.to_string(), o);
        Ok(())
    }

    fn unlink(&mut self, p: &str) -> Result<(), Errno> {
        let (d, n) = self.resolve(p)?;
        let n = n.ok_or(libc::ENOENT)?;
        if self.is_dir(n) {
            return Err(libc::EISDIR);
        }
        self.nodes[d].children.remove(split(p).1);
        Ok(())
    }

    fn rmdir(&mut self, p: &str) -> Result<(), Errno> {
        let (d, n) = self.resolve(p)?;
        let n = n.ok_or(libc::ENOENT)?;
        if !self.is_dir(n) {
            return Err(libc::ENOTDIR);
        }
        if !self.nodes[n].children.is_empty() {
            return Err(libc::ENOTEMPTY);
        }
        self.nodes[d].children.remove(split(p).1);
        Ok(())
    }

    /// Is `a` an ancestor of `b` or `b` itself (directories)?
    fn ancestor_or_self(&self, a: Id, mut b: Id) -> bool {
        loop {
            if a == b {
                return true;
            }
            if b == ROOT {
                return false;
            }
            b = self.nodes[b].parent;
        }
    }

    /// rename / renameat2 following the order of checks in fs/namei.c `do_renameat2` + `vfs_rename`.
    fn rename(
        &mut self,
        old: &str,
        new: &str,
        noreplace: bool,
        exchange: bool,
    ) -> Result<(), Errno> {
        let (oname, nname) = (split(old).1, split(new).1);
        let od = self.resolve_dir(split(old).0)?;
        let nd = self.resolve_dir(split(new).0)?;
        let o = self.nodes[od]
            .children
            .get(oname)
            .copied()
            .ok_or(libc::ENOENT)?;
        let n = self.nodes[nd].children.get(nname).copied();
        if noreplace && n.is_some() {
            return Err(libc::EEXIST);
        }
        if exchange && n.is_none() {
            return Err(libc::ENOENT);
        }
        if od != nd {
            // Source must not be an ancestor of the target's directory.
            if self.ancestor_or_self(o, nd) {
                return Err(libc::EINVAL);
            }
            // Target must not be an ancestor of the source.
            if let Some(n) = n {
                if self.ancestor_or_self(n, od) {
                    return Err(if exchange {
                        libc::EINVAL
                    } else {
                        libc::ENOTEMPTY
                    });
                }
            }
        }
        if n == Some(o) {
            return Ok(()); // same inode (hard links, or the same name): nothing to do
        }
        let odir = self.is_dir(o);
        if let Some(n) = n {
            let ndir = self.is_dir(n);
            if !exchange {
                if odir && !ndir {
                    return Err(libc::ENOTDIR);
                }
                if !odir && ndir {
                    return Err(libc::EISDIR);
                }
                if ndir && !self.nodes[n].children.is_empty() {
                    return Err(libc::ENOTEMPTY);
                }
            }
        }
        if exchange {
            let n = n.expect("checked above");
            self.nodes[od].children.insert(oname.to_string(), n);
            self.nodes[nd].children.insert(nname.to_string(), o);
            if self.is_dir(n) {
                self.nodes[n].parent = od;
            }
        } else {
            self.nodes[od].children.remove(oname);
            self.nodes[nd].children.insert(nname.to_string(), o);
        }
        if odir {
            self.nodes[o].parent = nd;
        }
        Ok(())
    }

    fn setxattr(&mut self, p: &str, name: &str, value: &[u8], flags: i32) -> Result<(), Errno> {
        let (_, n) = self.resolve(p)?;
        let n = n.ok_or(libc::ENOENT)?;
        if matches!(self.nodes[n].kind, Kind::Symlink(_)) {
            return Err(libc::EPERM); // user.* only on regular files and directories
        }
        let exists = self.nodes[n].xattrs.contains_key(name);
        if flags == libc::XATTR_CREATE && exists {
            return Err(libc::EEXIST);
        }
        if flags == libc::XATTR_REPLACE && !exists {
            return Err(libc::ENODATA);
        }
        self.nodes[n]
            .xattrs
            .insert(name.to_string(), value.to_vec());
        Ok(())
    }

    fn removexattr(&mut self, p: &str, name: &str) -> Result<(), Errno> {
        let (_, n) = self.resolve(p)?;
        let n = n.ok_or(libc::ENOENT)?;
        if matches!(self.nodes[n].kind, Kind::Symlink(_)) {
            return Err(libc::EPERM);
        }
        self.nodes[n]
            .xattrs
            .remove(name)
            .map(|_| ())
            .ok_or(libc::ENODATA)
    }

    /// Every path in the tree (depth first), with its node.
    fn paths(&self) -> Vec<(String, Id)> {
        let mut out = Vec::new();
        let mut stack = vec![(String::new(), ROOT)];
        while let Some((p, id)) = stack.pop() {
            for (name, &c) in &self.nodes[id].children {
                let cp = if p.is_empty() {
                    name.clone()
                } else {
                    format!("{p}/{name}")
                };
                out.push((cp.clone(), c));
                if self.is_dir(c) {
                    stack.push((cp, c));
                }
            }
        }
        out
    }

    /// Expected link counts of every reachable node.
    fn nlinks(&self) -> HashMap<Id, u64> {
        let mut m: HashMap<Id, u64> = HashMap::new();
        m.insert(ROOT, 2);
        for (_, id) in self.paths() {
            if self.is_dir(id) {
                *m.entry(id).or_default() += 2;
                let parent = self.nodes[id].parent;
                *m.entry(parent).or_default() += 1;
            } else {
                *m.entry(id).or_default() += 1;
            }
        }
        m
    }
}

fn errno_result(r: libc::c_int) -> Result<(), Errno> {
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(())
    }
}

fn io_result<T>(r: std::io::Result<T>) -> Result<T, Errno> {
    r.map_err(|e| e.raw_os_error().unwrap_or(0))
}

struct Runner {
    root: PathBuf,
    model: Model,
    rng: StdRng,
    seed: u64,
    log: VecDeque<String>,
    op: u64,
    /// (op name, ok?) -> count, for the summary.
    stats: BTreeMap<String, u64>,
    next_target: u64,
}

impl Runner {
    fn abs(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn pick_path(&mut self) -> String {
        let paths = self.model.paths();
        let r = self.rng.gen_range(0..10);
        let name = *NAMES.choose(&mut self.rng).expect("names");
        if r < 5 && !paths.is_empty() {
            return paths.choose(&mut self.rng).expect("non-empty").0.clone();
        }
        if r < 9 {
            // An existing directory (or, rarely, any node: ENOTDIR paths) plus a name.
            let dirs: Vec<&(String, Id)> = paths
                .iter()
                .filter(|(p, id)| (self.model.is_dir(*id) || r == 8) && p.matches('/').count() < 4)
                .collect();
            if dirs.is_empty() || self.rng.gen_range(0..4) == 0 {
                return name.to_string();
            }
            let d = &dirs.choose(&mut self.rng).expect("non-empty").0;
            return format!("{d}/{name}");
        }
        let depth = self.rng.gen_range(1..=3);
        (0..depth)
            .map(|_| *NAMES.choose(&mut self.rng).expect("names"))
            .collect::<Vec<_>>()
            .join("/")
    }

    fn check(&mut self, what: &str, model: Result<(), Errno>, real: Result<(), Errno>) {
        let tag = match (&model, &real) {
            (Ok(()), Ok(())) => "ok".to_string(),
            (Err(e), Err(r)) if e == r => errno_name(*e),
            _ => {
                let show = |r: &Result<(), Errno>| match r {
                    Ok(()) => "success".to_string(),
                    Err(e) => errno_name(*e),
                };
                let mut s = format!(
                    "namespace op #{} (seed {}, replay with CETRA_SEED={}): {what}\n  expected {} got {}\nrecent ops:\n",
                    self.op,
                    self.seed,
                    self.seed,
                    show(&model),
                    show(&real)
                );
                for l in &self.log {
                    let _ = writeln!(s, "  {l}");
                }
                panic!("{s}");
            }
        };
        let key = format!("{} -> {tag}", what.split(' ').next().unwrap_or(""));
        *self.stats.entry(key).or_default() += 1;
        if self.log.len() == 100 {
            self.log.pop_front();
        }
        self.log.push_back(format!("#{} {what} = {tag}", self.op));
    }

    fn step(&mut self) {
        self.op += 1;
        let a = self.pick_path();
        let b = self.pick_path();
        let (pa, pb) = (self.abs(&a), self.abs(&b));
        match self.rng.gen_range(0..100) {
            0..=14 => {
                let content = format!("file {a} op {}", self.op).into_bytes();
                let real = io_result(
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o644)
                        .open(&pa)
                        .and_then(|mut f| f.write_all(&content)),
                );
                let model = self.model.create(&a, Kind::File, content).map(|_| ());
                self.check(&format!("create {a}"), model, real);
            }
            15..=26 => {
                let c = cstr(&pa);
                // SAFETY: valid C string.
                let real = errno_result(unsafe { libc::mkdir(c.as_ptr(), 0o755) });
                let model = self.model.create(&a, Kind::Dir, Vec::new()).map(|_| ());
                self.check(&format!("mkdir {a}"), model, real);
            }
            27..=31 => {
                self.next_target += 1;
                let target = format!(
                    "nowhere~{}~{}",
                    self.next_target,
                    "x".repeat(self.rng.gen_range(0..200))
                );
                let real = io_result(std::os::unix::fs::symlink(&target, &pa));
                let model = self
                    .model
                    .create(&a, Kind::Symlink(target), Vec::new())
                    .map(|_| ());
                self.check(&format!("symlink {a}"), model, real);
            }
            32..=38 => {
                let (co, cn) = (cstr(&pa), cstr(&pb));
                // SAFETY: valid C strings; flags 0 = do not follow a final symlink.
                let real = errno_result(unsafe {
                    libc::linkat(libc::AT_FDCWD, co.as_ptr(), libc::AT_FDCWD, cn.as_ptr(), 0)
                });
                let model = self.model.link(&a, &b);
                self.check(&format!("link {a} {b}"), model, real);
            }
            39..=47 => {
                let real = io_result(std::fs::remove_file(&pa));
                let model = self.model.unlink(&a);
                self.check(&format!("unlink {a}"), model, real);
            }
            48..=54 => {
                let real = io_result(std::fs::remove_dir(&pa));
                let model = self.model.rmdir(&a);
                self.check(&format!("rmdir {a}"), model, real);
            }
            55..=79 => {
                let (noreplace, exchange, name) = match self.rng.gen_range(0..4) {
                    0 | 1 => (false, false, "rename"),
                    2 => (true, false, "rename-noreplace"),
                    _ => (false, true, "rename-exchange"),
                };
                let flags = if noreplace {
                    libc::RENAME_NOREPLACE
                } else if exchange {
                    libc::RENAME_EXCHANGE
                } else {
                    0
                };
                let (co, cn) = (cstr(&pa), cstr(&pb));
                // SAFETY: valid C strings.
                let real = errno_result(unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        co.as_ptr(),
                        libc::AT_FDCWD,
                        cn.as_ptr(),
                        flags,
                    )
                });
                let model = self.model.rename(&a, &b, noreplace, exchange);
                self.check(&format!("{name} {a} {b}"), model, real);
            }
            80..=91 => {
                let name = *XATTR_NAMES.choose(&mut self.rng).expect("names");
                let len = self.rng.gen_range(0..300);
                let value: Vec<u8> = (0..len).map(|_| self.rng.gen()).collect();
                let (flags, fname) = match self.rng.gen_range(0..3) {
                    0 => (0, "setxattr"),
                    1 => (libc::XATTR_CREATE, "setxattr-create"),
                    _ => (libc::XATTR_REPLACE, "setxattr-replace"),
                };
                let real = io_result(set_xattr(&pa, name.as_bytes(), &value, flags));
                let model = self.model.setxattr(&a, name, &value, flags);
                self.check(&format!("{fname} {a} {name} ({len} bytes)"), model, real);
            }
            _ => {
                let name = *XATTR_NAMES.choose(&mut self.rng).expect("names");
                let real = io_result(remove_xattr(&pa, name.as_bytes()));
                let model = self.model.removexattr(&a, name);
                self.check(&format!("removexattr {a} {name}"), model, real);
            }
        }
    }
}

/// Compare the real tree under `root` with the model: names, types, link counts, hard-link
/// identity, symlink targets, file contents and xattrs.
fn compare_tree(root: &Path, model: &Model, when: &str) {
    let nlinks = model.nlinks();
    let mut real_to_model: HashMap<u64, Id> = HashMap::new();
    let mut model_to_real: HashMap<Id, u64> = HashMap::new();
    let mut dirs = vec![(PathBuf::new(), ROOT)];
    let mut count = 0usize;
    while let Some((rel, id)) = dirs.pop() {
        let abs = root.join(&rel);
        let mut names: Vec<String> = std::fs::read_dir(&abs)
            .unwrap_or_else(|e| panic!("[{when}] readdir {}: {e}", abs.display()))
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        let want: Vec<String> = model.nodes[id].children.keys().cloned().collect();
        assert_eq!(names, want, "[{when}] entries of /{} differ", rel.display());
        for (name, &cid) in &model.nodes[id].children {
            count += 1;
            let crel = rel.join(name);
            let cabs = root.join(&crel);
            let st =
                lstat(&cabs).unwrap_or_else(|e| panic!("[{when}] lstat /{}: {e}", crel.display()));
            let node = &model.nodes[cid];
            let fmt = st.st_mode & libc::S_IFMT;
            let want_fmt = match node.kind {
                Kind::File => libc::S_IFREG,
                Kind::Dir => libc::S_IFDIR,
                Kind::Symlink(_) => libc::S_IFLNK,
            };
            assert_eq!(fmt, want_fmt, "[{when}] type of /{}", crel.display());
            assert_eq!(
                st.st_nlink,
                nlinks[&cid],
                "[{when}] link count of /{}",
                crel.display()
            );
            // Hard links: one real inode per model node, and vice versa.
            let prev = real_to_model.insert(st.st_ino, cid);
            assert!(
                prev.is_none_or(|p| p == cid),
                "[{when}] /{} has inode {} which also belongs to a different model node",
                crel.display(),
                st.st_ino
            );
            let prev = model_to_real.insert(cid, st.st_ino);
            assert!(
                prev.is_none_or(|p| p == st.st_ino),
                "[{when}] hard links of one file have different inode numbers ({:?} vs {}) at /{}",
                prev,
                st.st_ino,
                crel.display()
            );
            match &node.kind {
                Kind::Symlink(t) => {
                    let got = std::fs::read_link(&cabs).unwrap_or_else(|e| panic!("readlink: {e}"));
                    assert_eq!(
                        got,
                        Path::new(t),
                        "[{when}] symlink target of /{}",
                        crel.display()
                    );
                    assert_eq!(
                        usize::try_from(st.st_size).unwrap(),
                        t.len(),
                        "[{when}] symlink size of /{}",
                        crel.display()
                    );
                }
                Kind::File => {
                    let got = std::fs::read(&cabs)
                        .unwrap_or_else(|e| panic!("read /{}: {e}", crel.display()));
                    assert!(
                        got == node.content,
                        "[{when}] content of /{} differs",
                        crel.display()
                    );
                }
                Kind::Dir => dirs.push((crel.clone(), cid)),
            }
            if !matches!(node.kind, Kind::Symlink(_)) {
                let xs: BTreeMap<String, Vec<u8>> = list_xattrs(&cabs)
                    .unwrap_or_else(|e| panic!("listxattr /{}: {e}", crel.display()))
                    .into_iter()
                    .filter(|(n, _)| n.starts_with(b"user."))
                    .map(|(n, v)| (String::from_utf8_lossy(&n).into_owned(), v))
                    .collect();
                assert_eq!(xs, node.xattrs, "[{when}] xattrs of /{}", crel.display());
            }
        }
    }
    let st = lstat(root).expect("lstat root");
    assert_eq!(
        st.st_nlink, nlinks[&ROOT],
        "[{when}] link count of the root"
    );
    eprintln!("namespace: [{when}] tree matches the model ({count} names)");
}

#[test]
fn namespace_random_ops_match_model() {
    require_fuse!();
    let ops: u64 = std::env::var("CETRA_NS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let seed = seed("namespace");
    let lun = Lun::new(2 << 30);
    lun.mkfs(&["-q"]);
    let mount = Mount::new(&lun, "ns-node");
    let root = mount.path().to_path_buf();
    let mut r = Runner {
        root: root.clone(),
        model: Model::new(),
        rng: StdRng::seed_from_u64(seed),
        seed,
        log: VecDeque::new(),
        op: 0,
        stats: BTreeMap::new(),
        next_target: 0,
    };
    let t = Instant::now();
    for _ in 0..ops {
        r.step();
    }
    eprintln!("namespace: {ops} ops in {}", secs(t.elapsed()));
    for (k, v) in &r.stats {
        eprintln!("  {k}: {v}");
    }
    // The test must actually have exercised the interesting outcomes.
    for must in [
        "rename -> ok",
        "rename-exchange -> ok",
        "mkdir -> EEXIST",
        "rmdir -> ENOTEMPTY",
        "link -> ok",
    ] {
        assert!(
            r.stats.contains_key(must),
            "seed {seed}: outcome '{must}' never happened; stats {:?}",
            r.stats
        );
    }
    compare_tree(&root, &r.model, "before remount");
    mount.unmount();
    let mount = Mount::new(&lun, "ns-node");
    compare_tree(mount.path(), &r.model, "after remount");
    mount.unmount();
    lun.assert_fsck_clean();
}
