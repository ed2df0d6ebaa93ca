"""Lua scripts of the Redis backend: the shared LRU index, updated atomically with each write.

``commit`` points a key at its value and evicts least recently used keys until the total fits
the budget; ``touch`` checks a key's lifetime and refreshes its access order (``touch_many``:
many keys of one group at once); ``drop`` forgets a key; ``stats`` reads the totals; ``evict``
trims the store to a budget; ``pin`` moves a key out of (or back into) the LRU; ``walk``
answers a whole ``ChainWalk`` (one prefix lookup) with reads that refresh the LRU as ``touch``
does; ``sibling`` registers a sibling index entry. The key layout is described in
:mod:`mlxcache.backends.redis.keys`.

Every script gets ``ARGV[1..4]`` = key prefix, clock offset (ms), ttl (ms), idle_ttl (ms; 0 =
none) and its own arguments from ``ARGV[5]``. Time is the server's ``TIME`` plus the offset
(0 unless a test moved :mod:`mlxcache.backends.clock`), so every client agrees on it.
"""

import hashlib

from mlxcache.backends.redis.chunks import MAX_MANIFEST_BYTES
from mlxcache.backends.redis.stream import FIRST_READ

_LUA_COMMON = """
local P = ARGV[1]
local OFFSET, TTL, IDLE = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local LRU, SIZE, EXP, CHUNKS, TOTAL, CLOCK = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local ATIME, PINS = KEYS[7], KEYS[8]

-- index values are data anyone with access could have written: numbers are read strictly
-- (a malformed one counts as 0) and a chunk list is bounded, so no value can make a script
-- fail forever or loop for long
local function int_or_0(v)
  if type(v) == 'string' and #v <= 18 and string.match(v, '^%-?%d+$') then return tonumber(v) end
  return 0
end

local function chunk_names(info)
  local gen, n = string.match(info or '', '^([0-9a-f]+):(%d+)$')
  if not gen or #n > 6 or tonumber(n) > 65536 then return {} end
  local out = {}
  for i = 0, tonumber(n) - 1 do out[#out + 1] = P .. 'c:' .. gen .. ':' .. i end
  return out
end

local function unlink_chunks(info)
  for _, c in ipairs(chunk_names(info)) do redis.call('UNLINK', c) end
end

-- a value and its chunks expire after px ms of real time (0: never); the index decides
-- expiry on the (offset) clock, this only frees memory of values nobody reads again
local function expire_value(member, px)
  local names = chunk_names(redis.call('HGET', CHUNKS, member))
  names[#names + 1] = P .. 'v:' .. member
  for _, k in ipairs(names) do
    if px > 0 then redis.call('PEXPIRE', k, px) else redis.call('PERSIST', k) end
  end
end

local function total()
  local t = redis.call('GET', TOTAL)
  if t and int_or_0(t) == 0 and t ~= '0' then redis.call('SET', TOTAL, 0) end
  return int_or_0(t)
end

local function tick()
  local ok = redis.pcall('INCR', CLOCK)
  if type(ok) == 'number' then return ok end
  redis.call('SET', CLOCK, 1)
  return 1
end

-- a key that leads a sibling index entry takes the entry with it (i:sibof: key -> "name\\nlabel")
local function forget_sibling(member)
  local at = redis.call('HGET', P .. 'i:sibof', member)
  if not at then return end
  redis.call('HDEL', P .. 'i:sibof', member)
  local nl = string.find(at, '\\n', 1, true)
  if not nl then return end
  local idx, label = P .. 'i:s:' .. string.sub(at, 1, nl - 1), string.sub(at, nl + 1)
  local v = redis.call('HGET', idx, label)
  if v and string.sub(v, 1, #member + 1) == member .. '\\n' then redis.call('HDEL', idx, label) end
end

-- forget a key everywhere; returns 1 if its value still existed
local function drop(member)
  total()
  local size = int_or_0(redis.call('HGET', SIZE, member))
  if redis.call('HDEL', PINS, member) == 0 and size ~= 0 then
    redis.call('DECRBY', TOTAL, size)  -- pinned bytes are not in TOTAL
  end
  redis.call('HDEL', SIZE, member)
  redis.call('ZREM', LRU, member)
  redis.call('ZREM', EXP, member)
  redis.call('ZREM', ATIME, member)
  local info = redis.call('HGET', CHUNKS, member)
  if info then
    unlink_chunks(info)
    redis.call('HDEL', CHUNKS, member)
  end
  forget_sibling(member)
  return redis.call('UNLINK', P .. 'v:' .. member)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + OFFSET
end

-- real-time expiry of a value stored or read now: the sooner of ttl and idle_ttl
local function backstop(now, deadline)
  local px = IDLE
  if deadline then
    local left = math.max(1, deadline - now)
    if px == 0 or left < px then px = left end
  end
  return px
end

-- drop keys whose ttl passed, or unused for idle_ttl (pinned keys are in neither set)
local function sweep(now)
  while true do
    local gone = redis.call('ZRANGEBYSCORE', EXP, '-inf', now, 'LIMIT', 0, 512)
    for _, m in ipairs(gone) do drop(m) end
    if #gone < 512 then break end
  end
  if IDLE > 0 then
    while true do
      local gone = redis.call('ZRANGEBYSCORE', ATIME, '-inf', now - IDLE, 'LIMIT', 0, 512)
      for _, m in ipairs(gone) do drop(m) end
      if #gone < 512 then break end
    end
  end
end

local function evict_to(maxb, keep)
  local evicted = 0
  if maxb >= 0 then
    while total() > maxb do
      local lru = redis.call('ZRANGE', LRU, 0, 1)
      local victim = lru[1]
      if victim == keep then victim = lru[2] end
      if not victim then break end
      evicted = evicted + drop(victim)
    end
  end
  if total() < 0 then redis.call('SET', TOTAL, 0) end
  return evicted
end

-- whether a key is stored and live; an expired or vanished one is dropped. refresh: a read
-- (moves it to the recent end of the LRU and renews its idle time)
local function live(m, refresh)
  if redis.call('EXISTS', P .. 'v:' .. m) == 1 then
    if redis.call('HEXISTS', PINS, m) == 1 then return true end
    local now = now_ms()
    local dl, at = redis.call('ZSCORE', EXP, m), redis.call('ZSCORE', ATIME, m)
    if dl then dl = tonumber(dl) end
    if (dl and dl <= now) or (IDLE > 0 and at and tonumber(at) <= now - IDLE) then
      drop(m)
      return false
    end
    if refresh and redis.call('ZSCORE', LRU, m) then
      redis.call('ZADD', LRU, tick(), m)
      redis.call('ZADD', ATIME, now, m)
      if IDLE > 0 then expire_value(m, backstop(now, dl)) end
    end
    return true
  end
  if redis.call('HEXISTS', SIZE, m) == 1 then drop(m) end
  return false
end
"""

# KEYS: 8 index keys, value key, [chunk keys]
# ARGV[5..]: member, size, max_bytes (-1 = none), "gen:n" or "", manifest or "" (then the
#            value was SET by the same MULTI, just before this script)
_COMMIT = (
    _LUA_COMMON
    + """
local member, size, maxb = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local info, manifest = ARGV[8], ARGV[9]
local now = now_ms()
sweep(now)
local deadline = nil
if TTL > 0 then deadline = now + TTL end
local px = backstop(now, deadline)
local pinned = redis.call('HEXISTS', PINS, member) == 1
if pinned then px = 0 end
if manifest ~= '' then
  for i = 10, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then return {-1, 0} end
  end
  for i = 10, #KEYS do
    if px > 0 then redis.call('PEXPIRE', KEYS[i], px) else redis.call('PERSIST', KEYS[i]) end
  end
  if px > 0 then
    redis.call('SET', KEYS[9], manifest, 'PX', px)
  else
    redis.call('SET', KEYS[9], manifest)
  end
elseif px == 0 then
  redis.call('PERSIST', KEYS[9])
end
local old = redis.call('HGET', CHUNKS, member)
if old and old ~= info then unlink_chunks(old) end
if info ~= '' then redis.call('HSET', CHUNKS, member, info)
else redis.call('HDEL', CHUNKS, member) end
total()
if pinned then  -- a pinned key stays pinned: its bytes count against the pin budget
  redis.call('HSET', SIZE, member, size)
  redis.call('HSET', PINS, member, size)
  return {1, 0}
end
local old_size = int_or_0(redis.call('HGET', SIZE, member))
if old_size ~= 0 then redis.call('DECRBY', TOTAL, old_size) end
redis.call('HSET', SIZE, member, size)
redis.call('INCRBY', TOTAL, size)
redis.call('ZADD', LRU, tick(), member)
redis.call('ZADD', ATIME, now, member)
if deadline then redis.call('ZADD', EXP, deadline, member) else redis.call('ZREM', EXP, member) end
return {1, evict_to(maxb, member)}
"""
)

# KEYS: 8 index keys, value key. ARGV[5..]: member, refresh (1: a read, 0: a contains check).
# -> 1 if the key is live; an expired or vanished key is dropped (0).
_TOUCH = _LUA_COMMON + "if live(ARGV[5], ARGV[6] == '1') then return 1 end\nreturn 0\n"

# KEYS: 8 index keys, the value key of each member. ARGV[5]: refresh (as touch), ARGV[6..]:
# members. -> 1 or 0 per member, as touch: many keys of one group in one command.
_TOUCH_MANY = (
    _LUA_COMMON
    + """
local out, refresh = {}, ARGV[5] == '1'
for i = 6, #ARGV do
  if live(ARGV[i], refresh) then out[#out + 1] = 1 else out[#out + 1] = 0 end
end
return out
"""
)

# KEYS: 8 index keys. ARGV[5]: member.
_DROP = _LUA_COMMON + "return drop(ARGV[5])\n"

# KEYS: 8 index keys. -> {entries, bytes, pinned entries, pinned bytes}
_STATS = (
    _LUA_COMMON
    + """
sweep(now_ms())
local pinned = 0
for _, v in ipairs(redis.call('HVALS', PINS)) do pinned = pinned + int_or_0(v) end
local n = redis.call('HLEN', PINS)
return {redis.call('ZCARD', LRU) + n, total() + pinned, n, pinned}
"""
)

# KEYS: 8 index keys. ARGV[5]: max_bytes. Evict least recently used keys until the total
# fits (what opening with a smaller budget does: ``mlxcache gc``). -> number evicted
_EVICT = (
    _LUA_COMMON
    + """
sweep(now_ms())
return evict_to(tonumber(ARGV[5]), nil)
"""
)

# KEYS: 8 index keys, value key. ARGV[5..]: member, 1 (pin) or 0 (unpin), pin_max_bytes and
# max_bytes (-1 = none). -> {1 done, 0 not stored / not pinned, -1 over pin_max_bytes; evicted
# by an unpin, or the bytes pins hold when refused}
_PIN = (
    _LUA_COMMON
    + """
local m, on, pmax, maxb = ARGV[5], ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8])
local now = now_ms()
sweep(now)
if redis.call('EXISTS', KEYS[9]) == 0 then
  if redis.call('HEXISTS', SIZE, m) == 1 then drop(m) end
  return {0, 0}
end
local pinned = redis.call('HEXISTS', PINS, m) == 1
local size = int_or_0(redis.call('HGET', SIZE, m))
total()
if on then
  if pinned then return {1, 0} end
  if pmax >= 0 then
    local held = 0
    for _, v in ipairs(redis.call('HVALS', PINS)) do held = held + int_or_0(v) end
    if held + size > pmax then return {-1, held} end
  end
  redis.call('DECRBY', TOTAL, size)
  redis.call('ZREM', LRU, m)
  redis.call('ZREM', EXP, m)
  redis.call('ZREM', ATIME, m)
  redis.call('HSET', PINS, m, size)
  expire_value(m, 0)
  return {1, 0}
end
if not pinned then return {0, 0} end
redis.call('HDEL', PINS, m)
redis.call('INCRBY', TOTAL, size)
redis.call('ZADD', LRU, tick(), m)
redis.call('ZADD', ATIME, now, m)
local deadline = nil
if TTL > 0 then
  deadline = now + TTL
  redis.call('ZADD', EXP, deadline, m)
end
expire_value(m, backstop(now, deadline))
return {1, evict_to(maxb, m)}
"""
)

# KEYS: 8 index keys. ARGV[5..]: n, label_size, unit, labels, number of ends, number of
# extras, then n chain keys, n marks, n sibling index names, the ends (each: a count, then its
# keys) and the extras. The chain walk of ``base.ChainWalk`` with the reads of ``get`` (LRU
# refresh included) -> {k, rank, candidate keys, aligned, extras found (0/1), values read}
_WALK = (
    _LUA_COMMON
    + """
local n, size, unit = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local labels, n_ends, n_extras = ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
local at = 10
local chain, marks, sibs, ends, extras = {}, {}, {}, {}, {}
for i = 1, n do chain[i] = ARGV[at + i] end
for i = 1, n do marks[i] = ARGV[at + n + i] end
for i = 1, n do sibs[i] = ARGV[at + 2 * n + i] end
at = at + 3 * n + 1
for e = 1, n_ends do
  local c = tonumber(ARGV[at])
  local keys = {}
  for j = 1, c do keys[j] = ARGV[at + j] end
  ends[e] = keys
  at = at + c + 1
end
for x = 1, n_extras do extras[x] = ARGV[at + x - 1] end

local k = 0
while k < n and live(chain[k + 1], false) do k = k + 1 end

-- the candidate: an end (the whole chain found) or the longest live sibling entry
local rank, members = 0, {}
if k == n then
  for e = 1, n_ends do
    if live(ends[e][1], false) then rank, members = e, ends[e]; break end
  end
else
  local idx = P .. 'i:s:' .. sibs[k + 1]
  local label = string.sub(labels, k * size + 1, (k + 1) * size)
  local found = {}
  local count = redis.call('HLEN', idx)
  if count > 0 and count <= 64 then
    local all = redis.call('HGETALL', idx)
    for i = 1, #all, 2 do
      local f = all[i]
      if #f > 0 and #f < size and #f % unit == 0 and string.sub(label, 1, #f) == f then
        found[#found + 1] = {#f / unit, all[i + 1]}
      end
    end
  elseif count > 64 then
    local last = math.floor((size - 1) / unit)
    for lo = 1, last, 512 do
      local fields = {}
      for m = lo, math.min(last, lo + 511) do
        fields[#fields + 1] = string.sub(label, 1, m * unit)
      end
      local vals = redis.call('HMGET', idx, unpack(fields))
      for i = 1, #fields do
        if vals[i] then found[#found + 1] = {lo + i - 1, vals[i]} end
      end
    end
  end
  table.sort(found, function(a, b) return a[1] > b[1] end)
  for _, c in ipairs(found) do
    local keys = {}
    for key in string.gmatch(c[2], '[^\\n]+') do keys[#keys + 1] = key end
    if #keys > 0 and #keys <= 16 and live(keys[1], false) then rank, members = c[1], keys; break end
  end
end

local aligned = 0
for i = k, 1, -1 do
  if live(marks[i], false) then aligned = i; break end
end

local values, flags = {}, {}
local function read(m)
  local v = false
  if live(m, true) then  -- the first bytes and the size: a large value is streamed after
    local key = P .. 'v:' .. m
    v = {redis.call('GETRANGE', key, 0, FIRST_READ_BYTES - 1), redis.call('STRLEN', key)}
  end
  values[#values + 1] = v
end
for i = 1, k do read(chain[i]) end
if rank > 0 then
  for _, m in ipairs(members) do read(m) end
elseif aligned > 0 then
  read(marks[aligned])
end
for x = 1, n_extras do
  if live(extras[x], false) then flags[x] = 1; read(extras[x]) else flags[x] = 0 end
end
return {k, rank, members, aligned, flags, values}
"""
)
_WALK = _WALK.replace("FIRST_READ_BYTES", str(max(FIRST_READ, MAX_MANIFEST_BYTES)))

# KEYS: 8 index keys. ARGV[5..]: sibling index name, label, members joined by newlines, max
# entries (the index is emptied when full: its entries only help a walk find its candidates).
# The first member points back at its entry (i:sibof), so dropping it removes the entry.
_SIBLING = (
    _LUA_COMMON
    + """
local idx = P .. 'i:s:' .. ARGV[5]
if redis.call('HEXISTS', idx, ARGV[6]) == 0 and redis.call('HLEN', idx) >= tonumber(ARGV[8]) then
  redis.call('UNLINK', idx)
end
redis.call('HSET', idx, ARGV[6], ARGV[7])
local nl = string.find(ARGV[7], '\\n', 1, true)
local first = ARGV[7]
if nl then first = string.sub(ARGV[7], 1, nl - 1) end
redis.call('HSET', P .. 'i:sibof', first, ARGV[5] .. '\\n' .. ARGV[6])
return 1
"""
)

SCRIPTS = {
    "commit": _COMMIT,
    "touch": _TOUCH,
    "touch_many": _TOUCH_MANY,
    "drop": _DROP,
    "stats": _STATS,
    "evict": _EVICT,
    "pin": _PIN,
    "walk": _WALK,
    "sibling": _SIBLING,
}
SHAS = {name: hashlib.sha1(body.encode()).hexdigest() for name, body in SCRIPTS.items()}
