//! `fluxmem`: the command-line front end. Everything user-facing (argument parsing, progress
//! bars, exit codes, human output) lives here; the work is done by the library crates.

mod cli;
mod commands;
mod pipeline;
mod progress;

use clap::Parser;
use std::process::ExitCode;

/// Exit status when the command did its work but quarantined bad input records.
pub const EXIT_QUARANTINED: u8 = 3;
/// Exit status of a fatal error.
pub const EXIT_FATAL: u8 = 1;
/// Exit status of a `run` that finished but is degraded: a stage that was meant to produce
/// something produced nothing (every consolidate cluster failed, an enabled export wrote no
/// skill, every record read was quarantined). Precedence: 1 (error) over 4 over 3 (quarantined)
/// over 0.
pub const EXIT_DEGRADED: u8 = 4;

fn main() -> ExitCode {
    // Like other Unix tools, stop quietly when the reader of stdout goes away (`| head`).
    #[cfg(unix)]
    // Safety: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any thread starts: candle reads it when it first runs a parallel operation.
    fluxmem_models::tune_thread_pool();
    let cli = cli::Cli::parse();
    let settings = cli::Settings::from(&cli);
    match commands::run(cli.command, &settings) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(EXIT_FATAL)
        }
    }
}
