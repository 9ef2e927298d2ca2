//! A small random-mutation driver so the targets also run on a stable toolchain, where
//! libFuzzer's coverage instrumentation is unavailable. It is *not* coverage-guided: it mutates
//! the seed inputs (bit flips, byte overwrites with interesting values, inserts, deletes,
//! splices, truncation) and plain random buffers, for a fixed time, and stops at the first
//! panic, saving the input under `artifacts/<target>/`. That catches shallow decoder panics
//! and roundtrip breaks in CI; deep bugs need `cargo +nightly fuzz run`.
//!
//! Usage: `<target> [SECONDS] [--seed N] [--write-seeds DIR] [INPUT...]` — with input files,
//! runs each once (to reproduce an artifact) instead of fuzzing; `--write-seeds` stores the
//! seed inputs as files (the committed `seeds/<target>/` corpora libFuzzer starts from).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// splitmix64: tiny, seedable, good enough to drive mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0xfff,
    0x1000,
    0xffff,
    u32::MAX as u64,
    u64::MAX,
];

fn mutate(rng: &mut Rng, input: &mut Vec<u8>, pool: &[Vec<u8>]) {
    let rounds = 1 + rng.below(8);
    for _ in 0..rounds {
        let len = input.len();
        match rng.below(8) {
            0 | 1 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                input[i] = rng.next() as u8;
            }
            3 if len > 0 => {
                // An interesting little-endian value of 1, 2, 4 or 8 bytes.
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let w = [1, 2, 4, 8][rng.below(4)];
                let i = rng.below(len);
                for (k, b) in v.iter().take(w).enumerate() {
                    if let Some(x) = input.get_mut(i + k) {
                        *x = *b;
                    }
                }
            }
            4 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                input.splice(i..i, bytes);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below(len - i);
                input.drain(i..i + n.min(64));
            }
            6 if !pool.is_empty() => {
                // Splice a piece of another seed over this one.
                let other = &pool[rng.below(pool.len())];
                if !other.is_empty() && len > 0 {
                    let from = rng.below(other.len());
                    let n = 1 + rng.below((other.len() - from).min(256));
                    let at = rng.below(len);
                    for k in 0..n {
                        if let Some(x) = input.get_mut(at + k) {
                            *x = other[from + k];
                        }
                    }
                }
            }
            7 if len > 0 => input.truncate(rng.below(len)),
            _ => {}
        }
    }
}

fn save_artifact(name: &str, input: &[u8]) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts")
        .join(name);
    let _ = std::fs::create_dir_all(&dir);
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in input {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let path = dir.join(format!("crash-{h:016x}"));
    match std::fs::write(&path, input) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(could not save {}: {e})", path.display()),
    }
}

/// Entry point of every target binary in stable mode.
pub fn main(name: &str, target: fn(&[u8]), seeds: fn() -> Vec<Vec<u8>>) {
    let mut secs = 10u64;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut seed = now.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32);
    let mut files = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--write-seeds" {
            let dir = args.next().unwrap_or_else(|| usage(name));
            for (i, s) in seeds().iter().enumerate() {
                let p = std::path::Path::new(&dir).join(format!("seed-{i}"));
                if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&p, s)) {
                    eprintln!("{name}: cannot write {}: {e}", p.display());
                    std::process::exit(2);
                }
            }
            return;
        } else if a == "--seed" {
            seed = args
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| usage(name));
        } else if let Ok(n) = a.parse() {
            secs = n;
        } else if a.starts_with('-') {
            usage(name);
        } else {
            files.push(a);
        }
    }
    if !files.is_empty() {
        for f in files {
            let data = std::fs::read(&f).unwrap_or_else(|e| {
                eprintln!("{name}: cannot read {f}: {e}");
                std::process::exit(2)
            });
            target(&data);
            println!("{name}: {f}: ok");
        }
        return;
    }
    // Quiet the default hook: a panic is reported once, below, with the saved input.
    std::panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    let pool = seeds();
    let mut rng = Rng(seed);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut runs = 0u64;
    // Seeds as they are first: they must pass.
    let mut queue: Vec<Vec<u8>> = pool.clone();
    while Instant::now() < deadline || !queue.is_empty() {
        let input = queue.pop().unwrap_or_else(|| {
            if pool.is_empty() || rng.below(8) == 0 {
                let n = rng.below(5000);
                (0..n).map(|_| rng.next() as u8).collect()
            } else {
                let mut x = pool[rng.below(pool.len())].clone();
                mutate(&mut rng, &mut x, &pool);
                x
            }
        });
        runs += 1;
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            let at = save_artifact(name, &input);
            eprintln!("{name}: FAILED after {runs} runs (seed {seed}); input saved to {at}");
            std::process::exit(1);
        }
    }
    println!("{name}: {runs} runs in {secs} s, no failures (stable random mutation, seed {seed})");
}

fn usage(name: &str) -> ! {
    eprintln!("usage: {name} [SECONDS] [--seed N] [--write-seeds DIR] [INPUT...]");
    std::process::exit(2)
}
