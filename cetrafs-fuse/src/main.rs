//! mount.cetra: mount a CetraFS volume through FUSE.
//!
//! Exit status follows mount(8)'s helper conventions: 0 once the filesystem is mounted (the
//! daemon keeps serving it in the background), 1 for a usage error, 32 for a mount failure.
//! With `-f` the process stays in the foreground and exits when the filesystem is unmounted.

mod adapter;
mod creds;
mod daemon;
mod offload;
mod options;
mod uring;

use options::Command;

fn main() {
    let code = match options::parse(std::env::args_os().skip(1)) {
        Ok(Command::Help) => {
            println!("{}", options::USAGE);
            0
        }
        Ok(Command::Mount(args)) => daemon::run(&args),
        Err(e) => {
            eprintln!("mount.cetra: {e}");
            eprintln!("{}", options::USAGE);
            daemon::EXIT_USAGE
        }
    };
    std::process::exit(code);
}
