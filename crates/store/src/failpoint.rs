//! Failpoints for the in-memory stores: make chosen operations return an IO error, deterministically.

use crate::error::{StoreError, StoreResult};
use std::collections::BTreeMap;
use std::io;

/// Per target (an operation, perhaps narrowed to some keys): how many matching calls to let through,
/// then how many to fail.
#[derive(Debug)]
pub(crate) struct Failpoints<Target: Ord> {
    armed: BTreeMap<Target, (u64, u64)>,
    injected: u64,
}

impl<Target: Ord> Default for Failpoints<Target> {
    fn default() -> Self {
        Self { armed: BTreeMap::new(), injected: 0 }
    }
}

impl<Target: Ord> Failpoints<Target> {
    /// Lets the next `after` calls matching `target` succeed, then fails the following `times` calls.
    pub(crate) fn arm(&mut self, target: Target, after: u64, times: u64) {
        self.armed.insert(target, (after, times));
    }

    pub(crate) fn clear(&mut self) {
        self.armed.clear();
    }

    /// How many calls failed by a failpoint so far.
    pub(crate) fn injected(&self) -> u64 {
        self.injected
    }

    /// Counts one call of exactly `target`; an injected IO error if the failpoint says so.
    pub(crate) fn check(&mut self, target: &Target, name: &'static str) -> StoreResult<()> {
        self.check_matching(|armed| armed == target, name)
    }

    /// Counts one call against every armed target that `matches` it; an injected IO error if any of
    /// them says so. A target whose failures are spent is disarmed.
    pub(crate) fn check_matching(&mut self, matches: impl Fn(&Target) -> bool, name: &'static str) -> StoreResult<()> {
        let mut fail = false;
        self.armed.retain(|target, (after, times)| {
            if !matches(target) {
                return true;
            }
            if *after > 0 {
                *after -= 1;
                return true;
            }
            if *times > 0 {
                *times -= 1;
                fail = true;
            }
            *times > 0
        });
        if !fail {
            return Ok(());
        }
        self.injected += 1;
        Err(StoreError::io(name, io::Error::other("injected by failpoint")))
    }
}
