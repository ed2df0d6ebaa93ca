"""Lua scripts of the Redis backend: the shared LRU index, updated atomically with each write.

``commit`` points a key at its value and evicts least recently used keys until the total fits
the budget; ``touch`` refreshes access order; ``drop`` forgets a key; ``stats`` reads the
totals; ``evict`` trims the store to a budget. The key layout is described in
:mod:`mlxcache.backends.redis`.
"""

import hashlib

_LUA_COMMON = """
local P = ARGV[1]
local LRU, SIZE, EXP, CHUNKS, TOTAL, CLOCK = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

-- index values are data anyone with access could have written: numbers are read strictly
-- (a malformed one counts as 0) and a chunk list is bounded, so no value can make a script
-- fail forever or loop for long
local function int_or_0(v)
  if type(v) == 'string' and #v <= 18 and string.match(v, '^%-?%d+$') then return tonumber(v) end
  return 0
end

local function unlink_chunks(info)
  local gen, n = string.match(info, '^([0-9a-f]+):(%d+)$')
  if not gen or #n > 6 or tonumber(n) > 65536 then return end
  for i = 0, tonumber(n) - 1 do redis.call('UNLINK', P .. 'c:' .. gen .. ':' .. i) end
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

-- forget a key everywhere; returns 1 if its value still existed
local function drop(member)
  total()
  local size = int_or_0(redis.call('HGET', SIZE, member))
  if size ~= 0 then redis.call('DECRBY', TOTAL, size) end
  redis.call('HDEL', SIZE, member)
  redis.call('ZREM', LRU, member)
  redis.call('ZREM', EXP, member)
  local info = redis.call('HGET', CHUNKS, member)
  if info then
    unlink_chunks(info)
    redis.call('HDEL', CHUNKS, member)
  end
  return redis.call('UNLINK', P .. 'v:' .. member)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- drop index entries of keys whose TTL has passed (Redis expired the values themselves)
local function sweep(now)
  while true do
    local gone = redis.call('ZRANGEBYSCORE', EXP, '-inf', now, 'LIMIT', 0, 512)
    for _, m in ipairs(gone) do drop(m) end
    if #gone < 512 then return end
  end
end
"""

# KEYS: 6 index keys, value key, [chunk keys]
# ARGV: prefix, member, size, ttl_ms (0 = none), max_bytes (-1 = none), "gen:n" or "",
#       manifest or "" (then the value was SET by the same MULTI, just before this script)
_COMMIT = (
    _LUA_COMMON
    + """
local member, size, ttl, maxb = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local info, manifest = ARGV[6], ARGV[7]
local now = now_ms()
sweep(now)
if manifest ~= '' then
  for i = 8, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then return {-1, 0} end
  end
  for i = 8, #KEYS do
    if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
  end
  if ttl > 0 then
    redis.call('SET', KEYS[7], manifest, 'PX', ttl)
  else
    redis.call('SET', KEYS[7], manifest)
  end
end
local old = redis.call('HGET', CHUNKS, member)
if old and old ~= info then unlink_chunks(old) end
total()
local old_size = int_or_0(redis.call('HGET', SIZE, member))
if old_size ~= 0 then redis.call('DECRBY', TOTAL, old_size) end
redis.call('HSET', SIZE, member, size)
redis.call('INCRBY', TOTAL, size)
redis.call('ZADD', LRU, tick(), member)
if info ~= '' then redis.call('HSET', CHUNKS, member, info)
else redis.call('HDEL', CHUNKS, member) end
if ttl > 0 then redis.call('ZADD', EXP, now + ttl, member) else redis.call('ZREM', EXP, member) end
local evicted = 0
if maxb >= 0 then
  while total() > maxb do
    local lru = redis.call('ZRANGE', LRU, 0, 1)
    local victim = lru[1]
    if victim == member then victim = lru[2] end
    if not victim then break end
    evicted = evicted + drop(victim)
  end
end
if total() < 0 then redis.call('SET', TOTAL, 0) end
return {1, evicted}
"""
)

# KEYS: 6 index keys, value key. ARGV: prefix, member. Refresh LRU, or clean a vanished key.
_TOUCH = (
    _LUA_COMMON
    + """
if redis.call('EXISTS', KEYS[7]) == 1 then
  if redis.call('ZSCORE', LRU, ARGV[2]) then
    redis.call('ZADD', LRU, tick(), ARGV[2])
  end
  return 1
end
if redis.call('HEXISTS', SIZE, ARGV[2]) == 1 then drop(ARGV[2]) end
return 0
"""
)

# KEYS: 6 index keys. ARGV: prefix, member.
_DROP = _LUA_COMMON + "return drop(ARGV[2])\n"

# KEYS: 6 index keys. ARGV: prefix. -> {entries, bytes}
_STATS = (
    _LUA_COMMON
    + """
sweep(now_ms())
return {redis.call('ZCARD', LRU), total()}
"""
)

# KEYS: 6 index keys. ARGV: prefix, max_bytes. Evict least recently used keys until the total
# fits (what opening with a smaller budget does: ``mlxcache gc``). -> number evicted
_EVICT = (
    _LUA_COMMON
    + """
sweep(now_ms())
local maxb, evicted = tonumber(ARGV[2]), 0
while total() > maxb do
  local victim = redis.call('ZRANGE', LRU, 0, 0)[1]
  if not victim then break end
  evicted = evicted + drop(victim)
end
if total() < 0 then redis.call('SET', TOTAL, 0) end
return evicted
"""
)

SCRIPTS = {
    "commit": _COMMIT,
    "touch": _TOUCH,
    "drop": _DROP,
    "stats": _STATS,
    "evict": _EVICT,
}
SHAS = {name: hashlib.sha1(body.encode()).hexdigest() for name, body in SCRIPTS.items()}
