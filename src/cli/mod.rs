//! The daemon's side of the command line (mount, unmount, stat, sync);
//! `main.rs` holds the argument parsing and the other commands.

pub mod mount;
