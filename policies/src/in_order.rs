//! Looking up replicas in a list kept in replica order, the replicas asked in increasing order
//! (a merge of two sorted lists): each lookup moves forward only, so a whole walk over one list
//! reads the other once.

use crate::ReplicaId;

pub struct InOrder<'a, T> {
    rest: &'a [T],
    key: fn(&T) -> ReplicaId,
}

impl<'a, T> InOrder<'a, T> {
    /// `list` in increasing order of `key`.
    pub fn new(list: &'a [T], key: fn(&T) -> ReplicaId) -> Self {
        InOrder { rest: list, key }
    }

    /// The entry for `replica`; the replicas asked must increase from one call to the next.
    pub fn find(&mut self, replica: ReplicaId) -> Option<&'a T> {
        let before = self
            .rest
            .iter()
            .take_while(|e| (self.key)(e) < replica)
            .count();
        self.rest = &self.rest[before..];
        self.rest.first().filter(|e| (self.key)(e) == replica)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_what_is_there_moving_forward_only() {
        let list = [ReplicaId(1), ReplicaId(3), ReplicaId(4)];
        let mut cursor = InOrder::new(&list, |&r| r);
        let found: Vec<bool> = [0, 1, 2, 3, 5]
            .map(|r| cursor.find(ReplicaId(r)).is_some())
            .to_vec();
        assert_eq!(found, [false, true, false, true, false]);
    }
}
