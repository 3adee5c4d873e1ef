//! Failpoints for the in-memory stores: make chosen operations return an IO error, deterministically.

use crate::error::{StoreError, StoreResult};
use std::collections::BTreeMap;
use std::io;

/// Per operation: how many calls to let through, then how many to fail.
#[derive(Debug)]
pub(crate) struct Failpoints<Op: Ord> {
    armed: BTreeMap<Op, (u64, u64)>,
}

impl<Op: Ord> Default for Failpoints<Op> {
    fn default() -> Self {
        Self { armed: BTreeMap::new() }
    }
}

impl<Op: Ord + Copy> Failpoints<Op> {
    /// Lets the next `after` calls of `op` succeed, then fails the following `times` calls.
    pub(crate) fn arm(&mut self, op: Op, after: u64, times: u64) {
        self.armed.insert(op, (after, times));
    }

    pub(crate) fn clear(&mut self) {
        self.armed.clear();
    }

    /// Counts one call of `op`; an injected IO error if the failpoint says so.
    pub(crate) fn check(&mut self, op: Op, name: &'static str) -> StoreResult<()> {
        let Some((after, times)) = self.armed.get_mut(&op) else { return Ok(()) };
        if *after > 0 {
            *after -= 1;
            return Ok(());
        }
        if *times == 0 {
            self.armed.remove(&op);
            return Ok(());
        }
        *times -= 1;
        Err(StoreError::io(name, io::Error::other("injected by failpoint")))
    }
}
