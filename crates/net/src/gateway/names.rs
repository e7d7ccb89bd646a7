//! Which name the guest looked up for an address, so a connection to that
//! address is decided by name rules too (`*.debian.org:443` opens the
//! addresses the gateway itself answered for `deb.debian.org`).
//!
//! Only the gateway's own DNS answers fill it: the guest cannot make an
//! address pass for an allowed name. Bounded: the oldest entries go first.

use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;

pub(super) struct NameMap {
    names: HashMap<Ipv4Addr, String>,
    order: VecDeque<Ipv4Addr>,
    capacity: usize,
}

impl NameMap {
    pub fn new(capacity: usize) -> Self {
        Self {
            names: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remember `name` for `addr`; the latest answer for an address wins.
    pub fn insert(&mut self, addr: Ipv4Addr, name: &str) {
        if self.names.insert(addr, name.to_owned()).is_some() {
            self.order.retain(|a| *a != addr);
        }
        self.order.push_back(addr);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.names.remove(&old);
            }
        }
    }

    pub fn get(&self, addr: Ipv4Addr) -> Option<&str> {
        self.names.get(&addr).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_bounded_oldest_dropped_latest_wins() {
        let mut m = NameMap::new(2);
        let a = Ipv4Addr::new(192, 0, 2, 1);
        let b = Ipv4Addr::new(192, 0, 2, 2);
        let c = Ipv4Addr::new(192, 0, 2, 3);
        m.insert(a, "a.example");
        m.insert(b, "b.example");
        m.insert(a, "a2.example");
        m.insert(c, "c.example");
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(a), Some("a2.example"));
        assert_eq!(m.get(b), None);
        assert_eq!(m.get(c), Some("c.example"));
    }
}
